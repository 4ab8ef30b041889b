"""Dtype and reduction-op codes shared by the front end, the kernels and every backend.

The numbers are the C ABI of ``engines/kernels/reduce_kernels.h`` (their one definition for compiled code,
which ``_buffer`` and ``_core`` take from it), repeated here for the pure-Python path;
``tests/test_kernels.py`` checks that both agree.
Reduction-op codes equal torch's ``ReduceOp.RedOpType`` values.
"""

# dtype codes (COLL_* in reduce_kernels.h)
FLOAT16 = 0
BFLOAT16 = 1
FLOAT32 = 2
FLOAT64 = 3
COMPLEX64 = 4
COMPLEX128 = 5
INT8 = 6
UINT8 = 7
INT16 = 8
INT32 = 9
INT64 = 10
BOOL = 11

DTYPE_NAMES = {
    FLOAT16: "float16", BFLOAT16: "bfloat16", FLOAT32: "float32", FLOAT64: "float64",
    COMPLEX64: "complex64", COMPLEX128: "complex128", INT8: "int8", UINT8: "uint8",
    INT16: "int16", INT32: "int32", INT64: "int64", BOOL: "bool",
}
ITEMSIZE = {
    FLOAT16: 2, BFLOAT16: 2, FLOAT32: 4, FLOAT64: 8, COMPLEX64: 8, COMPLEX128: 16,
    INT8: 1, UINT8: 1, INT16: 2, INT32: 4, INT64: 8, BOOL: 1,
}
FLOATING = frozenset({FLOAT16, BFLOAT16, FLOAT32, FLOAT64})
COMPLEX = frozenset({COMPLEX64, COMPLEX128})
INTEGER = frozenset({INT8, UINT8, INT16, INT32, INT64})

# reduction-op codes (torch.distributed.ReduceOp.RedOpType values)
SUM = 0
AVG = 1
PRODUCT = 2
MIN = 3
MAX = 4
BAND = 5
BOR = 6
BXOR = 7
PREMUL_SUM = 8

OP_NAMES = {SUM: "SUM", AVG: "AVG", PRODUCT: "PRODUCT", MIN: "MIN", MAX: "MAX",
            BAND: "BAND", BOR: "BOR", BXOR: "BXOR", PREMUL_SUM: "PREMUL_SUM"}


def op_valid(dtype: int, op: int) -> bool:
    """Whether the elementwise kernels implement ``op`` (SUM..BXOR) on ``dtype``."""
    if op in (SUM, PRODUCT):
        return True
    if op in (MIN, MAX):
        return dtype not in COMPLEX
    if op in (BAND, BOR, BXOR):
        return dtype in INTEGER or dtype == BOOL
    return False
