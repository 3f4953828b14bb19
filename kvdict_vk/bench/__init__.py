"""Side-by-side benchmarks on one Vulkan device (and the CPU OMP against scikit-learn).

One module per benchmark — ``fixed``, ``attention``, ``encode``, ``omp``, ``reconstruct`` —
each with ``PRESETS`` (its options per size preset), ``parse_args(argv)``,
``run(args, progress) -> dict`` (the JSON), ``rows(result)`` (its summary.json rows),
``headline(result)`` (the figures kvdict-bench summarises), ``report``/``plot`` and a
standalone ``main(argv)``. What they share: ``common`` (statistics, interleaving,
output), ``timing`` (wall and GPU time of recorded submissions), ``traffic`` (bytes moved,
from the layout), ``roofline`` (the copy-shader ceiling), ``results`` (the row schema),
``torch_anchor`` (the optional PyTorch anchors: SDPA, CUDA round trip, device copy). ``kvdict-bench`` (kvdict_vk.cli.bench) runs them
together.
"""
