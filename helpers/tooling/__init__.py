"""Code the course runs but does not teach: learners don't need to read it.

Two layers live here (pyproject.toml's import contract, `lint-imports`): `ray_internals`, every private Ray API the
course relies on, is the foundation the lesson modules of helpers/ use; the rest drives lessons and sits above them
(the benchmark, the GPU lane, the KubeRay checks, the local multi-node cluster, the scripts' command lines, the
memory sampler, the run recorder), importing lesson modules and never imported by them.
"""
