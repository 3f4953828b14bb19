# The two commands of the README. Each first runs scripts/setup.sh, which installs what
# is missing (Debian packages, the virtualenv, kp built offline) and returns in about a
# second when everything is already there.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The embedded default device is Mesa's lavapipe; tests pin it and require it, so a
# missing Vulkan device fails the run instead of skipping it.
export KVDICT_VK_DEVICE      ?= llvmpipe
export KVDICT_EXPECT_DRIVER  ?= llvmpipe
export KVDICT_REQUIRE_DEVICE ?= 1

.PHONY: setup demo test shaders bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	@$(PY) -m kvdict_vk.cli.demo

test: setup
	@$(PY) -m pytest -q

bench: setup
	@$(PY) -m kvdict_vk.cli.bench

clean:
	rm -rf build dist *.egg-info kvdict_vk/spv .pytest_cache
