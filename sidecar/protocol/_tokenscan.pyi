# The C scanner (_tokenscan.c); fastchunk.TokenScan names the parts of its answer.
_Scan = tuple[int, int | None, int | None, int | None, int, int, int, int, int]

def scan(data: bytes | bytearray | memoryview, /) -> _Scan | None: ...
