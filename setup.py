"""The one thing pyproject.toml cannot say without an experimental table: the C extension.

`sidecar.protocol._tokenscan` recognises the common token chunk in C (fastchunk.py says why).
It is optional: where no C compiler is at hand the package installs without it and runs the
same regex, slower (`sidecar proxy` logs which one it runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.protocol._tokenscan",
            sources=["sidecar/protocol/_tokenscan.c"],
            optional=True,
        )
    ]
)
