"""ClassLRU's per-lookup work, compiled: the state in two flat arrays, the steps as numba functions.

`policy.ClassLRU` is the interface; this module holds what runs at every MoE layer of every token,
so that the policy costs a few microseconds whatever the number of experts (the engine calls it per
layer and token, the simulator per replayed lookup). One call covers a lookup whose experts are all
in slots; `step` is the whole lookup in one call, the CPU share, the counters and the lookup log
included (`lookup`, `settle` and `tally` are its parts).

State, int64 `st` (offsets in its header) and float64 `fl`:
- per slot: the key (layer * n_expert + expert, -1 empty) it holds, its class list and the list's
  links (prev, next), whether a prefetch filled it and its expert is unused since, a scratch mark;
- per class: the head and tail of its LRU list (least recent at the head);
- per layer: its clock; per key: its slot (-1 none) and the layer clock at its last use;
- per expert id: a scratch mark (the experts of the lookup at hand);
- per key: its selections by the lookups planned (every token's, repeats included), for the heat map;
- per layer: the CPU share's carry, and the planned lookups' counters (COUNTED) for small and large
  batches; in the header the share (in 1/SHARE_ONE) and whether lookups are counted;
- `fl`: the decay table 2^(-dt/128) for dt < 8192, then each key's CRF at its last use.
Float arithmetic is plain IEEE (no fast-math): the same values as the formulas in policy's doc.
"""

from __future__ import annotations

import numpy as np

from ..kernels.jit import njit
from .rules import (
    CRF_HALF_LIFE,
    LOGGED,
    N_CLASS,
    N_DECAY,
    PROTECT,
    PROTECT_RATIO,
    SECOND_USE,
    SECOND_USE_WINDOW,
    SHARE_ONE,
    SMALL_BATCH,
    UPLOAD_CAP,
    UPLOAD_CAP_RULE,
)

# Header of `st`: sizes, counters, then where each region starts.
H_SLOTS, H_EXPERT, H_LAYERS, H_FILLED, H_ADMIT, H_STAMP = 0, 1, 2, 3, 4, 5
H_KEY, H_PREV, H_NEXT, H_LIST, H_PREF, H_SMARK, H_HEAD, H_TAIL, H_CLOCK, H_SLOT, H_LAST, H_EMARK, H_USES = range(6, 19)
H_CARRY, H_COUNT, H_SHARE, H_COUNTING = 19, 20, 21, 22
HEADER = 24

# The counters of the planned lookups, per layer and batch size (small: <= SMALL_BATCH tokens, then
# large), in this order: as `stats.Counters` names them.
COUNTED = ("calls", "tokens", "lookups", "hits", "misses", "cpu", "uploads", "prefetch_hits")
N_COUNT = len(COUNTED)

# Regions of the `out` array a step fills (each n_expert long, after a header of counts). The result
# region holds the plan compactly, for one read: hits, CPU misses, uploads' experts, their slots,
# evictions' layers, their experts (6 regions' room).
O_MISSES, O_RECENT, O_CPU, O_UP_E, O_UP_S, O_EV_L, O_EV_E, O_SCRATCH, O_SCRATCH2, O_RESULT = range(10)
O_HITS = O_RESULT
O_HEADER = 8
N_OUT = 16


def new_state(n_layers: int, n_expert: int, n_slots: int, admission: int) -> tuple[np.ndarray, np.ndarray]:
    """(st, fl) of an empty group: every slot empty, in slot order at the front of class 0."""
    n_keys = n_layers * n_expert
    sizes = [
        (H_KEY, n_slots), (H_PREV, n_slots), (H_NEXT, n_slots), (H_LIST, n_slots), (H_PREF, n_slots),
        (H_SMARK, n_slots), (H_HEAD, N_CLASS), (H_TAIL, N_CLASS), (H_CLOCK, n_layers), (H_SLOT, n_keys),
        (H_LAST, n_keys), (H_EMARK, n_expert), (H_USES, n_keys), (H_CARRY, n_layers), (H_COUNT, n_layers * 2 * N_COUNT),
    ]  # fmt: skip
    st = np.zeros(HEADER + sum(n for _, n in sizes), np.int64)
    at = HEADER
    for field, n in sizes:
        st[field] = at
        at += n
    st[H_SLOTS], st[H_EXPERT], st[H_LAYERS], st[H_ADMIT], st[H_COUNTING] = n_slots, n_expert, n_layers, admission, 1
    region(st, H_KEY, n_slots)[:] = -1
    region(st, H_SLOT, n_keys)[:] = -1
    region(st, H_HEAD, N_CLASS)[:] = -1
    region(st, H_TAIL, N_CLASS)[:] = -1
    prev, nxt = region(st, H_PREV, n_slots), region(st, H_NEXT, n_slots)
    prev[:] = np.arange(-1, n_slots - 1)
    nxt[:] = np.arange(1, n_slots + 1)
    nxt[-1] = -1
    st[st[H_HEAD]] = 0
    st[st[H_TAIL]] = n_slots - 1
    fl = np.zeros(N_DECAY + n_keys, np.float64)
    fl[:N_DECAY] = [2.0 ** (-dt / CRF_HALF_LIFE) for dt in range(N_DECAY)]
    return st, fl


def region(st: np.ndarray, field: int, n: int) -> np.ndarray:
    """A view of one region of the state."""
    return st[st[field] : st[field] + n]


def new_out(n_expert: int) -> np.ndarray:
    return np.zeros(O_HEADER + N_OUT * n_expert, np.int64)


@njit(fastmath=False, cache=True)
def _class_of(c):
    """floor(log2(c)) for c >= 1, capped at the last class."""
    n = np.int64(c)
    cls = 0
    while n > 1 and cls < N_CLASS - 1:
        n >>= 1
        cls += 1
    return cls


@njit(fastmath=False, cache=True)
def _decay(fl, dt):
    if dt < N_DECAY:
        return fl[dt]
    return 2.0 ** (-dt / CRF_HALF_LIFE)


@njit(fastmath=False, cache=True)
def _unlink(st, s):
    prev, nxt, lst = st[H_PREV], st[H_NEXT], st[H_LIST]
    c = st[lst + s]
    p, n = st[prev + s], st[nxt + s]
    if p >= 0:
        st[nxt + p] = n
    else:
        st[st[H_HEAD] + c] = n
    if n >= 0:
        st[prev + n] = p
    else:
        st[st[H_TAIL] + c] = p


@njit(fastmath=False, cache=True)
def _append(st, s, c):
    prev, nxt = st[H_PREV], st[H_NEXT]
    tail = st[st[H_TAIL] + c]
    st[prev + s] = tail
    st[nxt + s] = -1
    if tail >= 0:
        st[nxt + tail] = s
    else:
        st[st[H_HEAD] + c] = s
    st[st[H_TAIL] + c] = s
    st[st[H_LIST] + s] = c


@njit(fastmath=False, cache=True)
def place(st, fl, layer, e, s):
    """Put expert e of `layer` into slot s, in the class list of its CRF; returns the key it evicts, or -1."""
    n_expert = st[H_EXPERT]
    key_at = st[H_KEY] + s
    old = st[key_at]
    st[st[H_PREF] + s] = 0  # a prefetched expert evicted unused: a wasted upload
    if old >= 0:
        st[st[H_SLOT] + old] = -1
    else:
        st[H_FILLED] += 1
    key = layer * n_expert + e
    st[key_at] = key
    st[st[H_SLOT] + key] = s
    c = fl[N_DECAY + key]
    _unlink(st, s)
    _append(st, s, _class_of(c) if c >= 1 else 0)
    return old


@njit(fastmath=False, cache=True)
def _selected(st, key, layer, stamp):
    """Whether `key` is one of the experts of `layer` the current step marked."""
    n_expert = st[H_EXPERT]
    return key // n_expert == layer and st[st[H_EMARK] + key % n_expert] == stamp


@njit(fastmath=False, cache=True)
def _candidate(st, fl, c, layer, stamp, taken_stamp):
    """The first slot of class list c that holds an expert the step did not select nor take: (slot, score)."""
    n_expert, key_of, nxt = st[H_EXPERT], st[H_KEY], st[H_NEXT]
    s = st[st[H_HEAD] + c]
    while s >= 0:
        key = st[key_of + s]
        if key >= 0 and not _selected(st, key, layer, stamp) and st[st[H_SMARK] + s] != taken_stamp:
            age = st[st[H_CLOCK] + key // n_expert] - st[st[H_LAST] + key]
            return s, age * (2.0**-c)
        s = st[nxt + s]
    return -1, -2.0


@njit(fastmath=False, cache=True)
def _victims(st, fl, m, layer, stamp, out, at):
    """The m slots that m misses take, into out[at:at+m]: empty slots first (they lead class 0), then
    one eviction each: among the candidate of each class list, the largest age / 2^class. Returns
    False when no slot can be evicted."""
    n_empty = min(m, st[H_SLOTS] - st[H_FILLED])
    s = st[st[H_HEAD]]
    for i in range(n_empty):
        out[at + i] = s
        s = st[st[H_NEXT] + s]
    need = m - n_empty
    if need == 0:
        return True
    scores = np.empty(N_CLASS, np.float64)
    slots = np.empty(N_CLASS, np.int64)
    taken = stamp  # slots marked with the step's stamp are taken
    for c in range(N_CLASS):
        slots[c], scores[c] = _candidate(st, fl, c, layer, stamp, taken)
    for n in range(need):
        best, best_score = -1, -1.0
        for c in range(N_CLASS):
            if scores[c] > best_score:
                best, best_score = c, scores[c]
        if best < 0:
            return False
        out[at + n_empty + n] = slots[best]
        if n + 1 == need:
            break
        st[st[H_SMARK] + slots[best]] = taken
        slots[best], scores[best] = _candidate(st, fl, best, layer, stamp, taken)
    return True


@njit(fastmath=False, cache=True)
def lookup(st, fl, layer, ids, n_tokens, out):
    """First step of a lookup of `ids` (the experts n tokens select in `layer`): counts each distinct
    expert's use (CRF, last use), moves the hits to the tail of their class lists. Fills out's hits,
    misses (with whether each was used within SECOND_USE_WINDOW) and counts: out[0] hits, out[1]
    misses, out[2] hits on prefetched experts. Returns the distinct experts' count; the caller
    refuses the lookup, unchanged, when that exceeds the slots."""
    n_expert, n_slots = st[H_EXPERT], st[H_SLOTS]
    st[H_STAMP] += 1
    stamp = st[H_STAMP]
    emark = st[H_EMARK]
    uniq = O_HEADER + O_SCRATCH * n_expert
    n_u = 0
    for i in range(ids.size):
        e = ids[i]
        if st[emark + e] != stamp:
            st[emark + e] = stamp
            out[uniq + n_u] = e
            n_u += 1
    if n_u > n_slots:
        return n_u
    base = layer * n_expert
    uses = st[H_USES] + base
    for i in range(ids.size):
        st[uses + ids[i]] += 1
    now = st[st[H_CLOCK] + layer]
    last, slot_of, pref = st[H_LAST], st[H_SLOT], st[H_PREF]
    hits, misses, recent = O_HEADER + O_HITS * n_expert, O_HEADER + O_MISSES * n_expert, O_HEADER + O_RECENT * n_expert
    n_h = n_m = n_p = 0
    for i in range(n_u):
        e = out[uniq + i]
        key = base + e
        c = fl[N_DECAY + key]
        was_recent = 0
        if c != 0.0:
            dt = now - st[last + key]
            c = c * _decay(fl, dt) + 1.0
            if dt <= SECOND_USE_WINDOW:
                was_recent = 1
        else:
            c = 1.0
        fl[N_DECAY + key] = c
        st[last + key] = now
        s = st[slot_of + key]
        if s >= 0:
            if st[pref + s]:
                st[pref + s] = 0
                n_p += 1
            cls = _class_of(c)
            _unlink(st, s)
            _append(st, s, cls)
            out[hits + n_h] = e
            n_h += 1
        else:
            out[misses + n_m] = e
            out[recent + n_m] = was_recent
            n_m += 1
    out[0], out[1], out[2] = n_h, n_m, n_p
    if n_m == 0:  # else settle advances the clock, once it has chosen victims by the clock as it is
        st[st[H_CLOCK] + layer] = now + n_tokens
    return n_u


@njit(fastmath=False, cache=True)
def _sort_by_crf(fl, base, v, n, descending):
    """Insertion sort of v[:n] by (CRF, expert) ascending, or (-CRF, expert) when descending."""
    for i in range(1, n):
        e = v[i]
        c = fl[N_DECAY + base + e]
        j = i - 1
        while j >= 0:
            d = fl[N_DECAY + base + v[j]]
            after = (d < c or (d == c and v[j] > e)) if descending else (d > c or (d == c and v[j] > e))
            if not after:
                break
            v[j + 1] = v[j]
            j -= 1
        v[j + 1] = e


@njit(fastmath=False, cache=True)
def _sort(v, lo, n):
    for i in range(lo + 1, lo + n):
        e = v[i]
        j = i - 1
        while j >= lo and v[j] > e:
            v[j + 1] = v[j]
            j -= 1
        v[j + 1] = e


@njit(fastmath=False, cache=True)
def settle(st, fl, layer, n_tokens, n_cpu, out):
    """Second step of a lookup with misses: the `n_cpu` least used misses go to the CPU, the rest are
    admitted (by the group's rule once it is full) into victim slots, in expert order; advances the
    layer's clock. Fills out's CPU misses (sorted), uploads (expert, slot) and evictions (layer,
    expert); counts out[3] cpu, out[4] uploads, out[5] evictions. Returns False when no slot can be
    evicted."""
    n_expert, n_slots = st[H_EXPERT], st[H_SLOTS]
    stamp = st[H_STAMP]
    base = layer * n_expert
    now = st[st[H_CLOCK] + layer]
    misses, recent = O_HEADER + O_MISSES * n_expert, O_HEADER + O_RECENT * n_expert
    cpu, up_e, up_s = O_HEADER + O_CPU * n_expert, O_HEADER + O_UP_E * n_expert, O_HEADER + O_UP_S * n_expert
    ev_l, ev_e = O_HEADER + O_EV_L * n_expert, O_HEADER + O_EV_E * n_expert
    work, victims = O_HEADER + O_SCRATCH * n_expert, O_HEADER + O_SCRATCH2 * n_expert
    n_m = out[1]
    # The misses, with their recent flags, into the work area: out[work + i], flag out[recent + i] kept aligned.
    for i in range(n_m):
        out[work + i] = out[misses + i]
    n_c = 0
    m0 = 0  # the misses still to place start here in work
    if n_cpu > 0:
        # The least used misses go to the CPU; one that keeps being used gains CRF and is cached.
        _sort_by_crf(fl, base, out[work : work + n_m], n_m, False)
        n_c = min(n_cpu, n_m)
        for i in range(n_c):
            out[cpu + i] = out[work + i]
        m0 = n_c
    n_up = n_ev = 0
    left = n_m - m0
    if left > 0:
        full = st[H_FILLED] == n_slots
        rule = st[H_ADMIT]
        if full and rule == SECOND_USE:
            # Admit only experts the layer used within the window; the flags belong to the misses' first order.
            kept = 0
            for i in range(m0, n_m):
                e = out[work + i]
                flag = 0
                for j in range(n_m):
                    if out[misses + j] == e:
                        flag = out[recent + j]
                        break
                if flag:
                    out[work + m0 + kept] = e
                    kept += 1
                else:
                    out[cpu + n_c] = e
                    n_c += 1
            left = kept
        elif full and rule == UPLOAD_CAP_RULE:
            cap = UPLOAD_CAP * n_tokens
            if left > cap:
                _sort_by_crf(fl, base, out[work + m0 : work + n_m], left, True)
                for i in range(cap, left):
                    out[cpu + n_c] = out[work + m0 + i]
                    n_c += 1
                left = cap
        _sort(out, work + m0, left)
        if not _victims(st, fl, left, layer, stamp, out, victims):
            return False
        if full and rule == PROTECT:
            # The most used misses meet the best victims first; a miss less used than its victim's
            # expert leaves that expert in its slot.
            order = out[work + m0 : work + m0 + left].copy()
            _sort_by_crf(fl, base, order, left, True)
            kept = 0
            for i in range(left):
                e, s = order[i], out[victims + i]
                vkey = st[st[H_KEY] + s]
                vage = st[st[H_CLOCK] + vkey // n_expert] - st[st[H_LAST] + vkey]
                if fl[N_DECAY + base + e] >= PROTECT_RATIO * (fl[N_DECAY + vkey] * _decay(fl, vage)):
                    out[work + m0 + kept] = e
                    out[victims + kept] = s
                    kept += 1
                else:
                    out[cpu + n_c] = e
                    n_c += 1
            # kept pairs in expert order
            for i in range(1, kept):
                e, s = out[work + m0 + i], out[victims + i]
                j = i - 1
                while j >= 0 and out[work + m0 + j] > e:
                    out[work + m0 + j + 1] = out[work + m0 + j]
                    out[victims + j + 1] = out[victims + j]
                    j -= 1
                out[work + m0 + j + 1] = e
                out[victims + j + 1] = s
            left = kept
        for i in range(left):
            e, s = out[work + m0 + i], out[victims + i]
            gone = place(st, fl, layer, e, s)
            if gone >= 0:
                out[ev_l + n_ev] = gone // n_expert
                out[ev_e + n_ev] = gone % n_expert
                n_ev += 1
            out[up_e + n_up] = e
            out[up_s + n_up] = s
            n_up += 1
    _sort(out, cpu, n_c)
    out[3], out[4], out[5] = n_c, n_up, n_ev
    # The plan compactly after the hits: cpu, uploads' experts and slots, evictions' layers and experts.
    at = O_HEADER + O_RESULT * n_expert + out[0]
    for src, n in ((cpu, n_c), (up_e, n_up), (up_s, n_up), (ev_l, n_ev), (ev_e, n_ev)):
        for i in range(n):
            out[at + i] = out[src + i]
        at += n
    st[st[H_CLOCK] + layer] = now + n_tokens
    return True


@njit(fastmath=False, cache=True)
def tally(st, layer, n_tokens, out):
    """Count a planned lookup (out as `lookup` and `settle` left it) in its layer's counters, while counting is on."""
    if st[H_COUNTING] == 0:
        return
    c = st[H_COUNT] + (layer * 2 + (1 if n_tokens > SMALL_BATCH else 0)) * N_COUNT
    n_h, n_m = out[0], out[1]
    st[c] += 1
    st[c + 1] += n_tokens
    st[c + 2] += n_h + n_m
    st[c + 3] += n_h
    st[c + 4] += n_m
    st[c + 5] += out[3]
    st[c + 6] += out[4]
    st[c + 7] += out[2]


@njit(fastmath=False, cache=True)
def step(st, fl, layer, ids, n_tokens, out, log):
    """A whole lookup, as the engine makes it at every MoE layer: `lookup`; with misses, `settle` with
    the CPU's part of a full group's misses taken at the group's share (st[H_SHARE], in 1/SHARE_ONE)
    through the layer's carry, which keeps it exact over many lookups; `tally`; and the lookup
    appended to `log` (an int32 buffer, log[0] its end: layer, experts per token, number of ids,
    hits, the ids) when it has room.

    Returns the hits on prefetched experts, plus LOGGED when the log took the lookup; -1 when no slot
    can be evicted; -2 - n when the lookup selects n distinct experts, more than the slots (nothing
    changed). out[3:6] are 0 for a lookup without misses."""
    n_u = lookup(st, fl, layer, ids, n_tokens, out)
    if n_u > st[H_SLOTS]:
        return -2 - n_u
    n_m = out[1]
    if n_m == 0:
        out[3], out[4], out[5] = 0, 0, 0
    else:
        n_cpu = 0
        q = st[H_SHARE]
        if q > 0 and st[H_FILLED] == st[H_SLOTS]:
            at = st[H_CARRY] + layer
            v = n_m * q + st[at]
            st[at] = v & (SHARE_ONE - 1)
            n_cpu = min(v >> 16, n_m)
        if not settle(st, fl, layer, n_tokens, n_cpu, out):
            return -1
    tally(st, layer, n_tokens, out)
    result = out[2]
    n = ids.size
    end = log[0] if log.size else 0
    if log.size and end + 4 + n <= log.size:
        log[end] = layer
        log[end + 1] = n // n_tokens
        log[end + 2] = n
        log[end + 3] = out[0]
        for i in range(n):
            log[end + 4 + i] = ids[i]
        log[0] = end + 4 + n
        result += LOGGED
    return result


@njit(fastmath=False, cache=True)
def step_rows(st, fl, layers, ids, out, log, res):
    """`step` for one token at each of several layers of the group, in order: layer layers[i] looked up
    with ids[i] ([n, k] int64); res[i] gets the step's result, the lookup's hits and its uploads. Returns
    the uploads of all rows where every step was planned and logged; else -1 (see res), having stopped
    at a refused lookup (the rows after it keep res as it was)."""
    uploads = 0
    clean = True
    for i in range(layers.size):
        r = step(st, fl, layers[i], ids[i], 1, out, log)
        res[i, 0] = r
        res[i, 1] = out[0]
        res[i, 2] = out[4]
        uploads += out[4]
        if r < 0:
            return -1
        if r & LOGGED == 0:
            clean = False
    return uploads if clean else -1


@njit(fastmath=False, cache=True)
def step_ahead_rows(st, fl, layers, ids, ahead, fetch, out, log, res):
    """`step_rows` with look-ahead, for a token whose lookups and predictions come together: row i's lookup
    as `step`, then, where ahead[i, 0] >= 0 and `fetch`, its prediction ahead[i] (-1 past its end) for layer
    layers[i] + 1 as `prefetch`, sparing row i's experts. res[i]: the step's result, hits, uploads and the
    prefetch's uploads. Returns the uploads of all rows where every step was planned and logged; else -1
    (see res), having stopped at a refused lookup or prefetch."""
    n_expert = st[H_EXPERT]
    uploads = 0
    clean = True
    for i in range(layers.size):
        r = step(st, fl, layers[i], ids[i], 1, out, log)
        res[i, 0] = r
        res[i, 1] = out[0]
        res[i, 2] = out[4]
        res[i, 3] = 0
        uploads += out[4]
        if r < 0:
            return -1
        if r & LOGGED == 0:
            clean = False
        if fetch and ahead[i, 0] >= 0:
            n = 0
            while n < ahead.shape[1] and ahead[i, n] >= 0:
                n += 1
            n_up = prefetch(st, fl, layers[i] + 1, ahead[i, :n], ids[i] + layers[i] * n_expert, out)
            if n_up < 0:
                res[i, 0] = -1
                return -1
            res[i, 3] = n_up
    return uploads if clean else -1


@njit(fastmath=False, cache=True)
def prefetch(st, fl, layer, ids, spare, out):
    """Put the predicted experts `ids` of `layer` in slots ahead of their lookup, marked prefetched; no use is
    counted. The slots of the keys `spare` (the lookup just made, whose experts are still to be read) are no
    one's victims; of the distinct predicted experts, as many as the other slots hold, best first. Fills out's
    uploads; returns their count."""
    n_expert, n_slots = st[H_EXPERT], st[H_SLOTS]
    st[H_STAMP] += 1
    stamp = st[H_STAMP]
    emark, slot_of, smark = st[H_EMARK], st[H_SLOT], st[H_SMARK]
    room = n_slots
    for i in range(spare.size):
        s = st[slot_of + spare[i]]
        if s >= 0 and st[smark + s] != stamp:
            st[smark + s] = stamp  # taken: `_victims` passes it over
            room -= 1
    base = layer * n_expert
    work, victims = O_HEADER + O_SCRATCH * n_expert, O_HEADER + O_SCRATCH2 * n_expert
    up_e, up_s = O_HEADER + O_UP_E * n_expert, O_HEADER + O_UP_S * n_expert
    n_pred = n_want = 0
    for i in range(ids.size):
        if n_pred == room:
            break
        e = ids[i]
        if st[emark + e] != stamp:
            st[emark + e] = stamp
            n_pred += 1
            if st[slot_of + base + e] < 0:
                out[work + n_want] = e
                n_want += 1
    if n_want == 0:
        return 0
    _sort(out, work, n_want)
    if not _victims(st, fl, n_want, layer, stamp, out, victims):
        return -1
    for i in range(n_want):
        e, s = out[work + i], out[victims + i]
        place(st, fl, layer, e, s)
        st[st[H_PREF] + s] = 1
        out[up_e + i] = e
        out[up_s + i] = s
    return n_want
