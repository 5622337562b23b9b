"""The policy kernel's codes and its smallest compiled pieces, shared by run_layer.py's stages and route.py.

The branch codes of every miss rule, fallback, eviction key storage, on-load rule, touch, routing family and
gate normalisation, each checked at import against its table (a name without its branch fails, naming it);
the `_prefetch` hint (an LLVM intrinsic), the event-log append `_log` and the miss rule `_fetches` (both
inlined into run_layer).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from runtime.core.kernel import evict as ek
from runtime.core.policy import FALLBACKS, ROUTES, RULES, WEIGHT_NORMS


def _codes(implemented: tuple[str, ...], table: tuple[str, ...], what: str) -> tuple[int, ...]:
    """The codes of the names this module has a branch for, after checking that they are exactly the names
    of `table` (`what` names it): a miss rule, fallback or eviction touch added to a table without its branch
    here fails at import, naming it (no branch falls through to another's rule)."""
    if set(implemented) != set(table):
        raise ImportError(f"runtime/core/kernel/primitives.py: {what} is {list(table)}, the kernel has branches for "
                          f"{list(implemented)} (no branch: {[n for n in table if n not in implemented]}; a branch "
                          f"for nothing: {[n for n in implemented if n not in table]})")
    return tuple(table.index(n) for n in implemented)


# one branch each in _fetches (miss rules), miss_rule (fallbacks), claim (eviction keys' victim searches and
# on-load rules) and rekey (eviction touches)
R_FETCH_ALL, R_THRESHOLD, R_FIRST_CHOICE, R_SUBSTITUTE_ALL, R_BAND = _codes(
    ("fetch_all", "threshold", "first_choice", "substitute_all", "band"), RULES, "runtime.core.policy.RULES")
F_SUBSTITUTE, F_DROP, F_HOST, F_LOWBIT = _codes(("substitute", "drop", "host", "lowbit"), FALLBACKS,
                                                "runtime.core.policy.FALLBACKS")
KY_INT, KY_INT_GAMMA1, KY_FLOAT, KY_QUEUE = _codes(("int", "int-gamma1", "float", "queue"), ek.KEYS,
                                                  "runtime.core.kernel.evict.KEYS")
OL_NONE, OL_LFUDA, OL_S3FIFO = _codes(("none", "lfuda", "s3fifo"), ek.ON_LOADS, "runtime.core.kernel.evict.ON_LOADS")
RT_OFF, RT_PRIOR, RT_WINDOW = _codes(("off", "cache-prior", "cache-route"), ROUTES, "runtime.core.policy.ROUTES")
WN_TOPK, WN_ALL, WN_SIGMOID = _codes(("softmax_topk", "softmax_all", "sigmoid_topk"), WEIGHT_NORMS,
                                     "runtime.core.policy.WEIGHT_NORMS")
T_LFU, T_LRU, T_CRF, T_BELADY, T_LFUDA, T_S3FIFO = _codes(("lfu", "lru", "crf", "belady", "lfuda", "s3fifo"),
                                                          ek.TOUCHES, "runtime.core.kernel.evict.TOUCHES")
# run_layer asks for token i + PF_AHEAD's input rows while deciding token i: a replay streams
# the trace from memory (tens of MB) and a token's decisions take ~100 ns, less than a miss to DRAM
PF_AHEAD = 8


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """`_prefetch(arr, i, j)` asks the CPU for the cache line of the 2-D array's element [i, j] ahead of its
    use (for reading); a hint only (no fault, no effect on any value)."""

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        idx = [context.cast(builder, v, t, types.intp) for v, t in zip(args[1:], sig.args[1:], strict=True)]
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], ary, idx, wraparound=False)
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])  # read, locality 3, data cache
        return context.get_dummy_value()

    return types.void(arr, i, j), codegen


@njit(cache=True, inline="always")
def _log(lg, n_logs, j, t, e, s):
    """Append (t, e[, s]) to the event log `lg` (log j of n_logs): counted even when the log is full."""
    n = n_logs[j]
    if n < lg.shape[0]:
        lg[n, 0] = t
        lg[n, 1] = e
        if lg.shape[1] > 2:
            lg[n, 2] = s
    n_logs[j] = n + 1


@njit(cache=True, inline="always")
def _index(arr, n, e):
    """The first position of e in arr[:n], or -1 (cache-aware routing's membership tests)."""
    for q in range(n):
        if arr[q] == e:
            return q
    return -1


@njit(cache=True, inline="always")
def _fetches(rule, j, wj, tau, tau_high):
    """The miss rule for the miss at rank j with gate weight wj: one branch per rule of RULES (checked at
    import), none falling through to another's."""
    if rule == R_FETCH_ALL:
        return True
    if rule == R_SUBSTITUTE_ALL:
        return False
    if rule == R_BAND:
        return j == 0 or wj < tau or wj >= tau_high
    if rule == R_THRESHOLD:
        return j == 0 or wj >= tau
    if rule == R_FIRST_CHOICE:
        return j == 0
    raise ValueError("run_layer: a miss rule without its branch in _fetches")


@intrinsic
def borrowed(typingctx, array):
    """`borrowed(array)`: a view of `array` (same data, shape and strides) that holds no reference. The stages
    take their arrays as arguments; every binding of an array numba counts with an atomic increment and
    decrement, which refprune leaves inside the token loop. A view whose meminfo is null turns each count into
    a test of a constant null, which LLVM removes. The caller keeps `array` alive while the view is used."""
    if not isinstance(array, types.Array):
        return None

    def codegen(context, builder, sig, args):
        view = context.make_array(sig.args[0])(context, builder, value=args[0])
        view.meminfo = cgutils.get_null_value(view.meminfo.type)
        view.parent = cgutils.get_null_value(view.parent.type)
        return view._getvalue()

    return array(array), codegen
