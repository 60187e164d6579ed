"""The one thing pyproject.toml cannot say without an experimental table: the C extensions.

`sidecar.protocol._tokenscan` recognises the common token chunk in C (fastchunk.py says why);
`sidecar.proxy._recvstamp` reads an upstream socket with the kernel's receive timestamp
(rxstamp.py); `sidecar.proxy._recordwire` writes a record's wire form (recordwire.py);
`sidecar._recordtypes` holds a timeline's packed column type (record.Int64s) and builds the
record's dataclasses without their per-field __init__ (record.slots_constructor). All are
optional: where no C compiler is at hand the package installs without
them and runs the same logic in Python, slower (`sidecar proxy` logs which scanner it runs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "sidecar.protocol._tokenscan",
            sources=["sidecar/protocol/_tokenscan.c"],
            depends=["sidecar/_methodcache.h", "sidecar/protocol/_laneapi.h"],
            optional=True,
        ),
        Extension(
            "sidecar.proxy._recvstamp",
            sources=["sidecar/proxy/_recvstamp.c"],
            depends=["sidecar/protocol/_laneapi.h"],
            optional=True,
        ),
        Extension(
            "sidecar.proxy._recordwire",
            sources=["sidecar/proxy/_recordwire.c"],
            optional=True,
        ),
        Extension(
            "sidecar._recordtypes",
            sources=["sidecar/_recordtypes.c"],
            optional=True,
        ),
    ]
)
