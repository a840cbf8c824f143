"""A model of the tma_pp K loop's synchronisation (csrc/sm90/mega/mainloop_smem.cuh,
cta_gemm_pingpong + k_loop_pingpong), run over random interleavings of the two warpgroups, the
TMA unit and the tensor cores. The CUDA code is the source of truth and the GPU tests check it;
this checks the protocol it implements (change both together): nothing deadlocks, a turn barrier
never holds two pending arrivals, no copy lands in a stage a warpgroup may still read, every chunk
is read from a stage holding that chunk, and the epilogue's stage (the task's last chunk's) is
never the target of a streamed copy. The mutation cases show the checks catch each mistake."""
import random

import pytest


def run_protocol(S, K, tasks, seed, stream=None, wait_release=True, last_arrive=False, prefetched_from=None):
    """One random schedule of `tasks` tasks of K chunks through S stages. The knobs default to
    the kernel's protocol: the next task's first `stream` (S - 1) chunks are streamed in, the
    producer waits for a stage's release before refilling it, warpgroup 1 skips its turn arrival
    after its last chunk, a prefetched task's prologue issues chunks from `prefetched_from` (S - 1)."""
    stream = S - 1 if stream is None else stream
    prefetched_from = S - 1 if prefetched_from is None else prefetched_from
    rng = random.Random(seed)
    tag = [None] * S                  # (task, chunk) a stage holds once landed
    inflight = {}                     # stage -> (task, chunk) issued, not landed
    landed = [0] * S                  # completed uses of each stage's full barrier
    releases = [0] * S                # warpgroup releases of a stage's current use (2 complete it)
    released = [0] * S                # completed uses of each stage's empty barrier
    reading = [set() for _ in range(S)]
    turn = {0: 0, 1: 0}               # pending arrivals on warpgroup w's turn barrier
    groups = {0: [], 1: []}           # per warpgroup: [stage, done] in issue order

    def copy(stage, task, chunk):
        assert stage not in inflight, f"stage {stage} reissued while a copy is in flight"
        assert not reading[stage], f"copy into stage {stage} while warpgroups {reading[stage]} may read it"
        inflight[stage] = (task, chunk)

    def warpgroup(w):
        seq, prefetched = 0, False
        for t in range(tasks):
            nxt = t + 1 < tasks and K >= S
            if w == 1:  # the producer (thread 128) is in warpgroup 1
                for c in range(prefetched_from if prefetched else 0, min(S, K)):
                    copy((seq + c) % S, t, c)
            yield "barrier", ("start", t)
            if w == 1:
                assert turn[0] == 0, "turn barrier of warpgroup 0 already has an arrival"
                turn[0] += 1
            for c in range(K):
                s, use = (seq + c) % S, (seq + c) // S
                yield "wait", lambda s=s, use=use: landed[s] > use
                yield "wait", lambda w=w: turn[w] > 0
                turn[w] -= 1
                assert tag[s] == (t, c), f"warpgroup {w} reads stage {s} holding {tag[s]}, wants {(t, c)}"
                reading[s].add(w)
                group = [s, False]
                groups[w].append(group)
                if w == 0 or c + 1 < K or last_arrive:
                    assert turn[1 - w] == 0, f"turn barrier of warpgroup {1 - w} gets a second arrival"
                    turn[1 - w] += 1
                yield "wait", lambda g=group: g[1]  # wait_group 0, then the promotion
                reading[s].discard(w)
                releases[s] += 1
                if releases[s] == 2:
                    releases[s], released[s] = 0, released[s] + 1
                ahead = c + S
                mine = ahead < K
                if w == 1 and (mine or (nxt and ahead - K < stream)):
                    if wait_release:
                        yield "wait", lambda s=s, use=use: released[s] > use
                    copy(s, t if mine else t + 1, ahead if mine else ahead - K)
                yield "step", None
            seq, prefetched = seq + K, nxt
            yield "barrier", ("end", t)
            last = (seq - 1) % S  # the epilogue tile lives in the last chunk's stage
            assert last not in inflight, f"a copy is in flight into the epilogue's stage {last}"
            assert tag[last] in ((t, K - 1), ("epilogue", t)), tag[last]
            tag[last] = ("epilogue", t)
            yield "barrier", ("epilogue", t)
        yield "done", None

    programs = {w: warpgroup(w) for w in (0, 1)}
    at = {w: next(programs[w]) for w in (0, 1)}
    for _ in range(1_000_000):
        ready = []
        for w in (0, 1):
            kind, arg = at[w]
            if kind == "wait" and not arg() or kind == "done":
                continue
            if kind == "barrier" and at[1 - w] != ("barrier", arg):
                continue
            ready.append(("wg", w))
        ready += [("tma", s) for s in inflight]
        ready += [("mma", w) for w in (0, 1) if any(not g[1] for g in groups[w])]
        if not ready:
            assert all(at[w][0] == "done" for w in (0, 1)), f"deadlock: {at[0][0]} / {at[1][0]}, turns {turn}"
            return
        kind, x = rng.choice(ready)
        if kind == "tma":
            tag[x] = inflight.pop(x)
            landed[x] += 1
        elif kind == "mma":  # a warpgroup's groups complete in order
            next(g for g in groups[x] if not g[1])[1] = True
        elif at[x][0] == "barrier":  # a CTA barrier: both pass together
            at = {w: next(programs[w]) for w in (0, 1)}
        else:
            at[x] = next(programs[x])
    raise AssertionError("schedule did not finish")


@pytest.mark.parametrize("S", [2, 3, 4, 5])
@pytest.mark.parametrize("K", [1, 2, 3, 4, 5, 13])
def test_pingpong_protocol_holds(S, K):
    for tasks in (1, 2, 4):
        for seed in range(12):
            run_protocol(S, K, tasks, seed)


@pytest.mark.parametrize("mutation,message", [
    (dict(stream=4), "epilogue"),                         # streaming S chunks hits the epilogue's stage
    (dict(wait_release=False), "may read it|holding"),    # refilling before both warpgroups released
    (dict(last_arrive=True), "already has an arrival"),   # an unbalanced turn barrier
    (dict(prefetched_from=4), "deadlock"),                # a prefetched task's S-th chunk never issued
])
def test_pingpong_protocol_catches_mistakes(mutation, message):
    with pytest.raises(AssertionError, match=message):
        for seed in range(40):
            run_protocol(4, 8, 3, seed, **mutation)
