"""Code the course runs but does not teach: learners don't need to read it.

The benchmark, the KubeRay checks, the local multi-node cluster, the scripts' command lines, the memory
sampler, and every private Ray API the course relies on (`ray_internals`).
"""
