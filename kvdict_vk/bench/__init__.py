"""Side-by-side benchmarks on one Vulkan device (and the CPU OMP against scikit-learn).

One module per benchmark — ``attention``, ``encode``, ``omp``, ``reconstruct`` — each with
``parse_args(argv)``, ``run(args, progress) -> dict`` (the JSON), ``headline(result)`` (the
figures kvdict-bench summarises), ``report``/``plot`` and a standalone ``main(argv)``;
what they share is in ``common``. ``kvdict-bench`` (kvdict_vk.cli.bench) runs them
together.
"""
