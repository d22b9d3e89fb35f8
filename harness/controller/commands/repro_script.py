# The body of every script `shardcheck repro` writes: it needs torch (and what the code under
# test imports), nothing of shardcheck's harness. The writer puts a header, CASE and the target's
# call_code_under_test above it; this file is kept valid Python so that it is linted and tested.
import argparse, datetime, hashlib, json, multiprocessing, os, sys, tempfile, time, traceback  # noqa: E401
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

CASE: dict = {}  # written above by shardcheck repro
TIMEOUT_S, GIVE_UP_S, SHOWN, EXIT_TOO_SLOW = 15.0, 600.0, 5, 3  # hung: no CPU time nor call in TIMEOUT_S (see watch)


def call_code_under_test(logits, rank):  # written above by shardcheck repro
    raise NotImplementedError


def generator(*key):
    """The inputs come from the seed exactly as shardcheck generated them: one torch generator a key."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def tokens(sc, i):
    g = generator(sc["seed"], "tokens", sc["data_ids"][i])
    return torch.randint(0, sc["vocab"], (sc["totals"][i],), generator=g, dtype=torch.int64)


def logit_rows(sc, stream, start, stop):
    """Rows [start, stop) of a sample (or the all-gather tail padding), blocks of 64 rows a generator."""
    out = []
    for block in range(start // 64, (stop - 1) // 64 + 1):
        tail = stream == len(sc["totals"])
        g = generator(sc["seed"], "logits", "tail" if tail else sc["data_ids"][stream], block)
        rows = torch.randn((64, sc["vocab"]), generator=g, dtype=torch.float32)
        pad = torch.ones(64, dtype=torch.bool) if tail else torch.arange(block * 64, block * 64 + 64) >= sc["totals"][stream]
        out.append((rows * torch.where(pad, 4.0, 2.0).unsqueeze(1)).to(getattr(torch, sc["dtype"])))
    return torch.cat(out)[start - start // 64 * 64: stop - start // 64 * 64]


def loss_weights(sc, i):
    """Per response token (w_logprob, w_entropy): loss = sum w_lp * logp - coef * sum w_ent * H."""
    g = generator(sc["seed"], "weights", sc["data_ids"][i])
    return torch.rand((2, sc["totals"][i] - sc["prompts"][i]), generator=g, dtype=torch.float32) * 2 - 1


def rank_rows(sc, layout):
    """The rank's rows as the run laid them out: pieces (stream, start, stop), vocab columns, shape."""
    rows = torch.cat([logit_rows(sc, *piece) for piece in layout["pieces"]])
    return rows[:, slice(*layout["columns"])].contiguous().reshape(layout["shape"])


def truth(sc):  # what the code under test must produce
    """Per sample, float64 log-probs and entropies of every response token, and d loss / d its rows."""
    out = []
    for i, (total, prompt) in enumerate(zip(sc["totals"], sc["prompts"])):
        rows = logit_rows(sc, i, 0, total).double().requires_grad_()
        logp_all = torch.log_softmax(rows / sc["temperature"], dim=-1)
        j = torch.arange(total - prompt)  # the row scoring response token j is prompt - 1 + j
        logp = logp_all[prompt - 1 + j, tokens(sc, i)[prompt + j]]
        entropy = -sc["entropy_sign"] * (logp_all.exp() * logp_all).sum(-1)[prompt - 1 + j]  # sign: the target's definition
        w = loss_weights(sc, i).double()
        loss = (w[0] * logp).sum() - sc["entropy_coef"] * (w[1] * entropy).sum() * sc["with_entropy"]
        (g,) = torch.autograd.grad(loss, rows, allow_unused=True) if loss.requires_grad else (None,)
        out.append((logp.detach(), entropy.detach(), g if g is not None else torch.zeros_like(rows)))
    return out


def rank_grad(sc, layout, samples):
    """The float64 gradient of the rank's rows (padding rows: none), its vocab columns."""
    zero = torch.zeros(sc["vocab"], dtype=torch.float64)
    rows = [samples[s][2][p] if s < len(samples) and p < len(samples[s][2]) else zero
            for s, a, b in layout["pieces"] for p in range(a, b)]
    want = torch.stack(rows).reshape(*layout["shape"][:-1], -1) if rows else torch.zeros(layout["shape"])
    return want[..., layout["columns"][0]:layout["columns"][1]]


def logged(name, fn, log):
    """torch.distributed's ``name``, writing each call (op, group, shapes, phase) to ``log``."""
    def call(*args, **kwargs):
        group = kwargs.get("group", next((a for a in args if isinstance(a, dist.ProcessGroup)), None))
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        shapes = [list(t.shape) for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
        op = next((a.name for a in [*args, *kwargs.values()] if isinstance(a, dist.ReduceOp.RedOpType)), "SUM" if name in ("all_reduce", "reduce_scatter_tensor") else "")
        phase = "backward" if torch._C._current_autograd_node() is not None else "forward"  # autograd runs it
        print(f"{ranks}\t{name}({op}) {shapes} in {phase}", file=log, flush=True)
        return fn(*args, **kwargs)
    return call


def run_rank(rank, world, folder, code, backend):
    sc, layout = CASE["scenario"], CASE["ranks"][rank]
    found, device = {"rank": rank}, torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    try:
        torch.cuda.set_device(device) if backend == "nccl" else None  # nccl: a GPU a rank
        with open(os.path.join(folder, f"calls.{rank}"), "w") as log:
            for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "all_to_all_single"):
                setattr(dist, name, logged(name, getattr(dist, name), log))
            dist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=GIVE_UP_S))  # hangs: main's progress watch
            tp, cp, sp = sc["tp"], sc["cp"], sc.get("sp", 1)  # the sequence axis: cp or sp, the other is 1
            tp_groups = [dist.new_group([c * tp + r for r in range(tp)]) for c in range(cp * sp)]
            cp_groups = [dist.new_group([c * tp + r for c in range(cp * sp)]) for r in range(tp)]
            seq = dict(cp_group=None, cp_rank=0, sp_group=cp_groups[layout["tp_rank"]], sp_rank=layout["cp_rank"], sp_size=sp) if sp > 1 else dict(cp_group=cp_groups[layout["tp_rank"]], cp_rank=layout["cp_rank"])
            logits = (leaf := rank_rows(sc, layout).to(device).requires_grad_()).clone()  # a model's output: not a leaf
            samples = range(len(sc["totals"]))
            info = SimpleNamespace(
                tokens=[tokens(sc, i).to(device) for i in samples], total_lengths=list(sc["totals"]),
                response_lengths=[sc["totals"][i] - sc["prompts"][i] for i in samples], layout=sc["layout"],
                with_entropy=sc["with_entropy"], entropy_coef=sc["entropy_coef"], temperature=sc["temperature"],
                chunk_size=sc["chunk_size"], max_seq_lens=[layout["shape"][1]] * len(samples) if sc["layout"] == "bshd" else None,
                tp_group=tp_groups[layout["cp_rank"]], tp_rank=layout["tp_rank"], **seq,
                tp_size=tp, cp_size=cp, share=layout["share"], data_path=sc["data_path"], knobs=sc["knobs"],
                rows=[(s, p) for s, a, b in layout["pieces"] for p in range(a, b)], **code)  # (sample, position) a row
            given = [logits.detach().clone()] + [t.clone() for t in info.tokens]
            with Writes([logits, *info.tokens]) as writes:
                log_probs, entropy = call_code_under_test(logits, info)
            found["changed_in_forward"] = changed([logits, *info.tokens], given, writes)
            given = [logits.detach().clone()] + [t.clone() for t in info.tokens]  # the backward's own changes
            keep = lambda xs: None if xs is None else [x.detach().cpu() if isinstance(x, torch.Tensor) else x for x in xs]  # noqa: E731
            found["log_probs"], found["entropy"] = keep(log_probs), keep(entropy)
            outs, feed = [], []
            for i, share in enumerate(layout["share"]):
                w = loss_weights(sc, i)[:, share].to(device) / sc.get("sp", 1)  # under sp: every rank's loss / sp
                outs.append(log_probs[i]), feed.append(w[0].to(getattr(log_probs[i], "dtype", torch.float32)))
                if sc["with_entropy"] and entropy is not None:
                    outs.append(entropy[i]), feed.append((-sc["entropy_coef"] * w[1]).to(getattr(entropy[i], "dtype", torch.float32)))
            # what is malformed is the value check's to report; the rest is differentiated
            fed = [(o, f) for o, f in zip(outs, feed) if getattr(o, "requires_grad", False) and o.shape == f.shape]
            fed_before = [f.clone() for _, f in fed]
            with Writes([logits, *info.tokens] + [f for _, f in fed]) as writes:
                torch.autograd.backward([o for o, _ in fed], [f for _, f in fed]) if fed else None
            found["changed_in_backward"] = changed([logits, *info.tokens] + [f for _, f in fed], given + fed_before, writes)
            found["grad"] = (leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)).cpu()
            dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001  (the finding is the exception itself)
        frames = traceback.extract_tb(exc.__traceback__)  # where in the code under test, if it got there
        at = next((f for f in reversed(frames) if f.filename.startswith(code["src"] or "?")), frames[-1])
        found["crash"] = f"{type(exc).__name__}: {exc} (at {at.filename}:{at.lineno})"
    torch.save(found, os.path.join(folder, f"result.{rank}.pt"))


def changed(now, before, writes):
    """The caller's tensors that changed (0: logits, then tokens, fed gradients): the op that wrote, its line."""
    return {k: writes.sites.get(k, "") for k, (a, b) in enumerate(zip(now, before)) if not torch.equal(a.detach(), b)}


class Writes(TorchDispatchMode):
    """Every op under it: one that writes into a watched tensor's memory is noted with its caller."""

    def __init__(self, tensors):
        super().__init__()
        self.memory, self.sites = [t.untyped_storage().data_ptr() for t in tensors], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for arg, value in zip(func._schema.arguments, args):
            dense = isinstance(value, torch.Tensor) and value.layout == torch.strided
            at = value.untyped_storage().data_ptr() if arg.is_write and dense else None
            if at in self.memory and self.memory.index(at) not in self.sites:
                line = next((f for f in reversed(traceback.extract_stack()) if "/torch/" not in f.filename and f.filename != __file__), None)
                self.sites[self.memory.index(at)] = f" ({func} at {line.filename}:{line.lineno})" if line else f" ({func})"
        return func(*args, **(kwargs or {}))


def findings(folder, world, hung, inplace):
    sc = CASE["scenario"]
    tol = lambda kind: CASE["tolerances"][sc["dtype"]][kind]  # noqa: E731  (atol, rtol)
    close = lambda got, want, t: (got.double() - want).abs() <= t[0] + t[1] * want.abs()  # noqa: E731  NaN: not
    saved = [os.path.join(folder, f"result.{r}.pt") for r in range(world)]  # a hung rank saved none
    results = [torch.load(path, weights_only=False) for path in saved if os.path.exists(path)]
    crashes = {c: [r["rank"] for r in results if r.get("crash") == c] for c in dict.fromkeys(r["crash"] for r in results if "crash" in r)}
    said = lambda c: f"rank{'s' * (len(crashes[c]) > 1)} {', '.join(map(str, crashes[c]))} raised {c}"  # noqa: E731
    # a rank that raised makes no more calls; a peer gone makes the backend raise: those follow from it
    out = [said(c) for c in crashes if not any(m in c for m in ("Connection closed", "Connection reset", "Timed out"))]
    if out:
        return out
    calls: dict[str, dict[int, list[str]]] = {}  # group -> rank -> its calls there, in order
    for r in range(world):
        for line in open(os.path.join(folder, f"calls.{r}")).read().splitlines():
            group, call = line.split("\t")
            calls.setdefault(group, {}).setdefault(r, []).append(call)
    for group, by_rank in calls.items():  # every member of a group: the same calls, in the same order
        members = json.loads(group)
        seqs = [by_rank.get(r, []) for r in members]
        for n in range(max(map(len, seqs))):
            issued = [seq[n] if n < len(seq) else "no call" for seq in seqs]
            if len(set(issued)) > 1:
                return [f"collective mismatch in group {members} call {n}: " + "; ".join(
                    f"rank {r} issued {c}" if c != "no call" else f"rank {r} made no call" for r, c in zip(members, issued))]
    if crashes:
        return [said(c) for c in crashes]
    if hung:
        return [f"ranks {hung} made no progress for {TIMEOUT_S:.0f} s (no CPU time, no call), with no collective mismatch logged"]
    names = ["the logits", *(f"sample {i}'s tokens" for i in range(len(sc["totals"]))), "a gradient fed to backward"]
    for res in results if inplace else []:  # --no-inplace (or the run's): not checked
        for when in ("forward", "backward"):
            for name, site in {names[min(k, len(names) - 1)]: s for k, s in res[f"changed_in_{when}"].items()}.items():
                out.append(f"rank {res['rank']} changed {name} in place in the {when}{site}")
    samples = truth(sc)  # once: every rank's share and rows are sliced from it
    for res in results:
        layout = CASE["ranks"][res["rank"]]
        want_grad = rank_grad(sc, layout, samples)
        for i, ((lp, ent, _), share) in enumerate(zip(samples, layout["share"])):
            for field, got, want in (("log-prob", res["log_probs"], lp[share]), *[("entropy", res["entropy"], ent[share])] * sc["with_entropy"]):
                if got is None:
                    continue
                if not isinstance(got[i], torch.Tensor) or got[i].shape != want.shape:
                    out.append(f"rank {res['rank']} sample {i}: {field} is {getattr(got[i], 'shape', got[i])}, want shape {list(want.shape)}")
                    continue
                for j in (~close(got[i], want, tol("values"))).nonzero().flatten().tolist()[:SHOWN]:
                    out.append(f"rank {res['rank']} sample {i} response token {layout['share'][i][j]}: {field} {got[i][j].item():.8g}, want {want[j].item():.8g}")
        bad = (~close(res["grad"], want_grad, tol("grad"))).nonzero().tolist()
        for where in bad[:SHOWN]:
            out.append(f"rank {res['rank']} logits row {where[:-1]} column {layout['columns'][0] + where[-1]}: gradient "
                       f"{res['grad'][tuple(where)].item():.8g}, want {want_grad[tuple(where)].item():.8g}")
        out += [f"rank {res['rank']}: {len(bad) - SHOWN} more gradient elements off"] * (len(bad) > SHOWN)
    return out


def watch(procs, folder):  # (hung, slow): the ranks alive with neither CPU time nor a call for TIMEOUT_S, or at GIVE_UP_S
    seen, start = (), time.monotonic()  # a rank starved of a CPU still gets some CPU time: it is not hung
    while alive := [r for r, p in enumerate(procs) if p.is_alive()]:
        try:  # per rank: utime + stime of its process (Linux; elsewhere nothing is known), the size of its call log
            state = [(open(f"/proc/{procs[r].pid}/stat").read().rsplit(")", 1)[1].split()[11:13], os.path.getsize(f"{folder}/calls.{r}")) for r in alive]
        except OSError:  # not Linux, a log not begun, or a rank just ended
            state = None
        now = time.monotonic()
        if now - start > GIVE_UP_S or (state == seen and now - last > TIMEOUT_S):
            return ([], alive) if now - start > GIVE_UP_S else (alive, [])
        seen, last = state, (last if state == seen else now)
        procs[alive[0]].join(0.2)
    return [], []


def main(code, inplace, backend="gloo"):
    world = CASE["scenario"]["tp"] * CASE["scenario"]["cp"] * CASE["scenario"].get("sp", 1)
    with tempfile.TemporaryDirectory(prefix="repro-") as folder:
        ctx = multiprocessing.get_context("fork")  # torch is loaded once; nothing of it has run yet
        procs = [ctx.Process(target=run_rank, args=(r, world, folder, code, backend), daemon=True) for r in range(world)]
        [p.start() for p in procs]
        hung, slow = watch(procs, folder)
        [(p.kill() if p.is_alive() else None, p.join()) for p in procs]
        found = [] if slow else findings(folder, world, hung, inplace)
    what = f"{CASE['target'].split(':')[0]}{':' + code['variant'] if code['variant'] else ''} (from {code['src']}) on scenario {CASE['scenario']['name']}"
    if slow:
        print(f"GAVE UP on {what}: ranks {slow} still moving after {GIVE_UP_S:.0f} s (a machine too slow, or a loop): no finding either way")
        return EXIT_TOO_SLOW
    if found:
        print(f"FOUND in {what}: " + "; ".join(found[:SHOWN * 2]) + ("" if len(found) <= SHOWN * 2 else f"; and {len(found) - SHOWN * 2} more"))
        return 1
    print(f"NOT FOUND: {what} matched the float64 truth in every value and gradient and issued the same collectives "
          "on every rank of each group; " + ("it left its inputs unchanged." if inplace else "inputs changed in place: "
                                             "not checked (--no-inplace)."))
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "repro").splitlines()[0])
    ap.add_argument("--src", default=CASE["code"]["src"], help="the checkout of the code under test")
    ap.add_argument("--variant", default=CASE["code"]["variant"], help="the target's variant ('none': the plain one)")
    ap.add_argument("--no-inplace", action="store_true", help="do not check for inputs changed in place")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="nccl: a GPU a rank, the logits on it")
    args = ap.parse_args()
    if args.backend == "nccl" and torch.cuda.device_count() < CASE["scenario"]["tp"] * CASE["scenario"]["cp"] * CASE["scenario"].get("sp", 1):
        ap.error(f"--backend nccl: a GPU a rank, and this machine has {torch.cuda.device_count()}")
    sys.exit(main({"src": args.src, "variant": None if args.variant in (None, "none") else args.variant},
                  CASE["inplace"] and not args.no_inplace, args.backend))
