# The two commands of the README. Each first runs scripts/setup.sh, which installs what
# is missing (Debian packages, the virtualenv, kp built offline) and returns in about a
# second when everything is already there.
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	@bash scripts/setup.sh

# The demo runs on $KVDICT_VK_DEVICE (an index or a name substring) when it is set, else on
# Mesa's lavapipe, and says which one it ran on: `KVDICT_VK_DEVICE=1 make demo`.
demo: setup
	@$(PY) -m kvdict_vk.cli.demo

# The tests pin lavapipe and require it, so a missing Vulkan device fails the run instead
# of skipping it. To run them on another device, set all three, e.g.
# `make test KVDICT_VK_DEVICE=nvidia KVDICT_EXPECT_DRIVER=nvidia`.
test: export KVDICT_VK_DEVICE      ?= llvmpipe
test: export KVDICT_EXPECT_DRIVER  ?= llvmpipe
test: export KVDICT_REQUIRE_DEVICE ?= 1
test: setup
	@$(PY) -m pytest -q

bench: setup
	@$(PY) -m kvdict_vk.cli.bench

clean:
	rm -rf build dist *.egg-info kvdict_vk/spv .pytest_cache
