#!/usr/bin/env python3
"""Kept for old command lines: the benchmark lives in kvdict_vk.bench.encode (all four run
together with `kvdict-bench`)."""
from kvdict_vk.bench.encode import main

raise SystemExit(main())
