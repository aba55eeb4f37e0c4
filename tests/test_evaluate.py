"""Evaluation (issue 41 item 5): `pm.evaluate(*inputs, target=...)` runs the global batch forward
only through the pipeline (runtime/execution/executor.py [Note: forward-only steps]) and returns the mean
loss on every rank.

Through `autoplan.partition` on gloo ranks, each layout is checked against
- a single process's forward loss of the same model and batch, in eval mode: within 1e-6 in fp32
  (2e-2 for the bf16 and fp16 plans);
- itself: `step`'s loss on the same weights and batch (models without attached aux losses);
- memory: autograd saves no tensor during `evaluate` (a `saved_tensors_hooks` count that is > 0
  around `step`), and the executor holds no micro-batch state afterwards;
- the training it sits in: `step`, `evaluate`, optimizer step, `evaluate`, `step` gives exactly (bit
  for bit) the losses and gradients of the same run without the evaluations.
Plus: the forward-only action lists of every schedule finish; dropout is off during `evaluate` and
back on after it, also where a traced graph fixed it (and batch norm) in training mode.
Default tier: FSDP (zero 3, dp 2), one process, dropout at pp 2, the action lists; the `extended`
tier runs pp / zb-h1 / interleaved / recompute, ZeRO-1/2, tp + sp, cp, ep (+ expert tp), bf16,
fp16, tp 2 x pp 2, FSDP under pp and HSDP, and the traced-graph eval mode.
"""

from __future__ import annotations

import pytest
import torch
from _dist import make_plan, run_ranks
from torch import nn

import autoplan
from autoplan.schedule.actions import ActionKind, forward_only, make_schedule

LLAMA = "llama:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16"
GPT = "gpt:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"  # ties its head to the embedding
MOE = ("moe:num_layers=2,hidden_size=32,num_heads=4,num_kv_heads=2,ffn_hidden_size=48,vocab_size=64,max_seq_len=16,"
       "num_experts=4,experts_per_token=2,num_shared_experts=1")
GLOBAL_BATCH, MICRO_BATCH, SEQ = 8, 2, 16


def _plan(spec: str, ranks: int, dtype: str = "fp32", **pins):
    return autoplan.suggest(spec, f"1x{ranks}xcpu", global_batch=GLOBAL_BATCH, seq_len=SEQ, dtype=dtype,
                            micro_batch_size=MICRO_BATCH, top=1, **pins)[0]


# ---- the forward-only action lists -----------------------------------------------------------------
@pytest.mark.parametrize("name,ranks,microbatches,virtual", [
    ("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("zb-h1", 4, 6, 1),
    ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 4, 8, 2), ("interleaved-1f1b", 2, 4, 3),
])
def test_forward_only_lists_run_every_forward_and_finish(name, ranks, microbatches, virtual):
    """Lock-step run of the lowered forward-only lists: sends never block, a RECV_F waits for its
    SEND_F; every rank ends, having run F of each of its stages for every micro-batch."""
    schedule = make_schedule(name, ranks, microbatches, virtual)
    lists = [forward_only(actions) for actions in schedule.with_comms()]
    for rank, actions in enumerate(lists):
        assert all(a.kind in (ActionKind.F, ActionKind.SEND_F, ActionKind.RECV_F) for a in actions)
        assert sorted((a.stage, a.microbatch) for a in actions if a.kind is ActionKind.F) == sorted(
            (s, m) for s in schedule.stages_of_rank(rank) for m in range(microbatches))
    sent: set[tuple[int, int]] = set()
    ptr = [0] * ranks
    while any(ptr[r] < len(lists[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            while ptr[r] < len(lists[r]):
                a = lists[r][ptr[r]]
                if a.kind is ActionKind.RECV_F and (a.stage - 1, a.microbatch) not in sent:
                    break
                if a.kind is ActionKind.SEND_F:
                    sent.add((a.stage, a.microbatch))
                ptr[r] += 1
                progressed = True
        assert progressed, f"{name}: stuck at {[str(lists[r][ptr[r]]) for r in range(ranks) if ptr[r] < len(lists[r])]}"


# ---- evaluate through autoplan.partition -----------------------------------------------------------
def _local_grads(pm) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in pm.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.to_local() if hasattr(g, "to_local") else g).detach().clone()
    return out


def _counting_saved_tensors(counter: list[int]):
    def pack(t):
        counter[0] += 1
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _training(spec: str, plan, evaluate: bool) -> dict:
    """step(b0) [evaluate(b0) before it, evaluate(b1) after it], optimizer step, [evaluate(b1)],
    step(b1) on a fresh partitioned model: losses, gradients and what the evaluations saw."""
    pm = autoplan.partition(spec, plan, device="cpu")
    optimizer = pm.make_optimizer(torch.optim.AdamW, lr=1e-2)
    template = pm.output_template
    batches = [pm.source.batch(0, k, GLOBAL_BATCH, SEQ, template.shape, template.dtype) for k in range(2)]
    out: dict = {}

    def run_eval(key: str, batch) -> None:
        inputs, target = batch
        saved = [0]
        with _counting_saved_tensors(saved):
            loss = pm.evaluate(*inputs, target=target)
        out[key] = float(loss)
        out[key + "_saved"] = saved[0]
        out[key + "_left"] = len(pm.executor._state) + len(pm.executor._local_fwd)
        out[key + "_requires_grad"] = loss.requires_grad

    if evaluate:
        run_eval("eval0", batches[0])
        out["grads_after_eval0"] = len(_local_grads(pm))
    saved = [0]
    with _counting_saved_tensors(saved):
        loss = pm.step(*batches[0][0], target=batches[0][1])
    out["step_saved"] = saved[0]
    out["loss0"] = None if loss is None else float(loss)
    if evaluate:
        run_eval("eval1", batches[1])  # between the step and the optimizer's: its gradients stay
    out["grads0"] = _local_grads(pm)
    optimizer.step()
    if evaluate:
        run_eval("eval2", batches[1])  # the stepped weights
    loss = pm.step(*batches[1][0], target=batches[1][1])
    out["loss1"] = None if loss is None else float(loss)
    out["grads1"] = _local_grads(pm)
    return out


def _rank_job(rank: int, world_size: int, cases: dict) -> dict:
    return {name: {"with": _training(spec, plan, True), "without": _training(spec, plan, False)}
            for name, (spec, plan) in cases.items()}


def _reference(spec: str) -> list[float]:
    """One process, eval mode, no gradients: the mean loss of batches 0 and 1 over the plans'
    micro-batches at the initial weights (the same as the whole batch's mean: equal chunks)."""
    from autoplan.sources import parse_source

    source = parse_source(spec)
    model = source.build("cpu")
    model.eval()
    template_shape = (GLOBAL_BATCH, SEQ, 64)
    losses = []
    with torch.no_grad():
        for k in range(2):
            (ids, *_), target = source.batch(0, k, GLOBAL_BATCH, SEQ, template_shape, torch.float32)
            chunks = GLOBAL_BATCH // MICRO_BATCH
            losses.append(sum(float(source.loss_fn(model(ids[i * MICRO_BATCH:(i + 1) * MICRO_BATCH]),
                                                   target[i * MICRO_BATCH:(i + 1) * MICRO_BATCH]))
                              for i in range(chunks)) / chunks)
    return losses


def _check(cases: dict, results: dict) -> None:
    references = {spec: _reference(spec) for spec in {spec for spec, _ in cases.values()}}
    for name, (spec, plan) in cases.items():
        ref0, ref1 = references[spec]
        rtol = 1e-6 if plan.job.dtype in ("fp32", "float32") else 2e-2  # bf16 / fp16 against fp32
        attached_aux = spec == MOE  # its router loss is attached (autoplan.attach_aux_loss): in step's loss only
        for rank, result in results.items():
            run, plain = result[name]["with"], result[name]["without"]
            where = f"{name} rank {rank}"
            # every rank gets the loss, equal to one process's forward
            assert run["eval0"] == pytest.approx(ref0, rel=rtol, abs=1e-7), (where, run["eval0"], ref0)
            assert run["eval1"] == pytest.approx(ref1, rel=rtol, abs=1e-7), (where, run["eval1"], ref1)
            if run["loss1"] is not None and not attached_aux:  # the same weights and batch as step
                assert run["eval0"] == pytest.approx(run["loss0"], rel=1e-6), (where, run["eval0"], run["loss0"])
                assert run["eval2"] == pytest.approx(run["loss1"], rel=1e-6), (where, run["eval2"], run["loss1"])
            assert run["eval2"] != run["eval1"], where  # it sees the optimizer's step
            # nothing kept for a backward, no gradient written
            for key in ("eval0", "eval1", "eval2"):
                assert run[key + "_saved"] == 0 and run[key + "_left"] == 0, (where, key, run[key + "_saved"])
                assert not run[key + "_requires_grad"], (where, key)
            assert run["step_saved"] > 0, where  # the count sees what a step saves
            assert run["grads_after_eval0"] == 0, where
            # the training around it is exactly the same
            assert (run["loss0"], run["loss1"]) == (plain["loss0"], plain["loss1"]), where
            for key in ("grads0", "grads1"):
                assert run[key].keys() == plain[key].keys() and run[key], (where, key)
                for n in run[key]:
                    torch.testing.assert_close(run[key][n], plain[key][n], rtol=0, atol=0,
                                               msg=lambda m, n=n, key=key, where=where: f"{where} {key} {n}: {m}")


DEFAULT = {  # FSDP's units put back after forwards alone (the dropout test below runs pp 2 by default)
    "dp2-zero3": (LLAMA, dict(tp=1, pp=1, dp=2, zero=3)),
}
MORE = {  # 2 ranks each
    "pp2": (LLAMA, dict(tp=1, pp=2, dp=1)),
    "ep2": (MOE, dict(tp=1, pp=1, dp=2, ep=2)),
    "pp2-zb-h1": (LLAMA, dict(tp=1, pp=2, dp=1, schedule="zb-h1")),
    "pp2-interleaved-tied": (GPT, dict(tp=1, pp=2, dp=1, schedule="interleaved-1f1b", virtual_stages=2)),
    "pp2-gpipe-recompute": (LLAMA, dict(tp=1, pp=2, dp=1, schedule="gpipe", recompute="full")),
    "dp2-zero1": (LLAMA, dict(tp=1, pp=1, dp=2, zero=1)),
    "dp2-zero2": (LLAMA, dict(tp=1, pp=1, dp=2, zero=2)),
    "tp2-sp": (LLAMA, dict(tp=2, pp=1, dp=1, sequence_parallel=True)),
    "cp2": (LLAMA, dict(tp=1, pp=1, dp=2, cp=2)),
    "ep2-tp2": (MOE, dict(tp=2, pp=1, dp=1, ep=2)),
    "bf16-pp2": (LLAMA, dict(tp=1, pp=2, dp=1, dtype="bf16")),
    "bf16-dp2-zero1": (LLAMA, dict(tp=1, pp=1, dp=2, zero=1, dtype="bf16")),
    "bf16-dp2-zero3": (LLAMA, dict(tp=1, pp=1, dp=2, zero=3, dtype="bf16")),
    "fp16-pp2": (LLAMA, dict(tp=1, pp=2, dp=1, dtype="fp16")),
}
FOUR_RANKS = {
    "tp2-pp2": (LLAMA, dict(tp=2, pp=2, dp=1)),
    "pp2-dp2-zero2": (LLAMA, dict(tp=1, pp=2, dp=2, zero=2)),
    "hsdp": (LLAMA, dict(tp=1, pp=1, dp=4, zero=3, dp_replicate=2)),
}


def _run_layouts(layouts: dict, ranks: int, timeout_s: float) -> None:
    cases = {name: (spec, _plan(spec, ranks, **pins)) for name, (spec, pins) in layouts.items()}
    for name, (_, plan) in cases.items():  # the plan is the layout asked for
        pins = layouts[name][1]
        assert all(getattr(plan, k) == v for k, v in pins.items() if k != "dtype"), (name, plan)
    _check(cases, run_ranks(_rank_job, ranks, cases, timeout_s=timeout_s, pg_timeout_s=timeout_s / 3))


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_evaluate_matches_one_process_and_leaves_training_unchanged():
    _run_layouts(DEFAULT, 2, 380)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_evaluate_in_more_layouts():
    _run_layouts(MORE, 2, 880)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(900)
def test_evaluate_at_tp2_pp2_and_under_fsdp_with_pp_and_hsdp():
    _run_layouts(FOUR_RANKS, 4, 880)


def test_evaluate_on_one_process_and_its_error_without_a_target():
    from autoplan.runtime.parallel.errors import PartitionError

    plan = _plan(LLAMA, 1)
    pm = autoplan.partition(LLAMA, plan, device="cpu")
    template = pm.output_template
    (ids, *_), target = pm.source.batch(0, 0, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
    loss = pm.evaluate(ids, target=target)
    assert loss.shape == () and loss.dtype == torch.float32 and not loss.requires_grad
    assert float(loss) == pytest.approx(_reference(LLAMA)[0], rel=1e-6)
    assert all(p.grad is None for p in pm.parameters())
    assert float(pm.step(ids, target=target)) == pytest.approx(float(loss), rel=1e-6)
    with pytest.raises(PartitionError, match=r"^evaluate\(\) needs inputs .*target=\.\.\. for the loss"):
        pm.evaluate(ids)


# ---- dropout -----------------------------------------------------------------------------------------
class _DropoutLM(nn.Module):
    """Dropout between every layer: in train mode two forwards of one batch differ."""

    def __init__(self, vocab: int = 64, hidden: int = 32, num_layers: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(0.5))
                                    for _ in range(num_layers))
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids):
        x = self.drop(self.emb(ids))
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _lm_loss(logits, target):
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def _dropout_data():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (GLOBAL_BATCH, SEQ), generator=generator)
    return ids, torch.roll(ids, -1, dims=1)


def _dropout_job(rank: int, world_size: int, plan) -> dict:
    torch.manual_seed(0)
    model = _DropoutLM()
    ids, target = _dropout_data()
    pm = autoplan.partition(model, plan, example_inputs=(ids[:1],), loss_fn=_lm_loss, example_target=target[:1],
                            device="cpu")
    evals = [float(pm.evaluate(ids, target=target)) for _ in range(2)]
    modes = {m.training for stage in pm.stages.values() for m in stage.module.modules()}
    steps = [pm.step(ids, target=target) for _ in range(2)]
    return dict(evals=evals, modes=modes, steps=[None if s is None else float(s) for s in steps])


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_evaluate_turns_dropout_off_and_back_on():
    from autoplan.graph.profile import model_fingerprint
    from autoplan.graph.trace import trace_model

    torch.manual_seed(0)
    model = _DropoutLM()
    ids, target = _dropout_data()
    traced = trace_model(model, (ids[:1],))
    plan = make_plan("dropout-lm", model_fingerprint(model), traced.block_names, pp=2, micro_batch_size=MICRO_BATCH,
                     num_microbatches=GLOBAL_BATCH // MICRO_BATCH, seq_len=SEQ)
    results = run_ranks(_dropout_job, 2, plan, timeout_s=180, pg_timeout_s=60)
    model.eval()  # the ranks' weights: the same seed's
    with torch.no_grad():
        chunks = GLOBAL_BATCH // MICRO_BATCH
        expected = sum(float(_lm_loss(model(i), t)) for i, t in zip(ids.chunk(chunks), target.chunk(chunks))) / chunks
    for rank, r in results.items():
        assert r["evals"][0] == r["evals"][1] == pytest.approx(expected, rel=1e-6), (rank, r["evals"], expected)
        assert r["modes"] == {True}, rank  # train mode is back
    steps = results[1]["steps"]
    assert steps[0] != steps[1], steps  # dropout is on again in step (two draws of one batch differ)


# ---- eval mode inside traced graphs ------------------------------------------------------------------
GPT2_DROPOUT = ("hf:gpt2:n_layer=2,n_embd=32,n_head=4,vocab_size=64,n_positions=16,resid_pdrop=0.1,embd_pdrop=0.1,"
                "attn_pdrop=0.1")


class _BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _traced_eval_job(rank: int, world_size: int, gpt2_plan, bn_plan) -> dict:
    pm = autoplan.partition(GPT2_DROPOUT, gpt2_plan, device="cpu")
    template = pm.output_template
    inputs, target = pm.source.batch(0, 0, GLOBAL_BATCH, SEQ, template.shape, template.dtype)
    gpt2 = dict(evals=[float(pm.evaluate(*inputs, target=target)) for _ in range(2)],
                steps=[float(pm.step(*inputs, target=target)) for _ in range(2)])
    torch.manual_seed(0)
    net = _BatchNormNet()  # the test's weights and batch: the same seed, the same order
    x, y = torch.randn(GLOBAL_BATCH, 3, 8, 8), torch.randint(0, 4, (GLOBAL_BATCH,))
    pm = autoplan.partition(net, bn_plan, example_inputs=(x[:1],), loss_fn=nn.functional.cross_entropy,
                            example_target=y[:1], device="cpu", tracer="export")
    stats = lambda: {n: t.clone() for n, t in pm.state_dict().items() if "running" in n}  # noqa: E731
    before = stats()
    bn = dict(eval=float(pm.evaluate(x, target=y)), unchanged=stats(), tracer=pm.plan.tracer)
    pm.step(x, target=y)
    bn["stepped"] = stats()
    return dict(gpt2=gpt2, bn=bn, before=before)


@pytest.mark.extended
@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_evaluate_runs_dropout_and_batch_norm_fixed_in_a_traced_graph_as_eval_mode():
    """A transformers GPT-2 (torch.export: `aten.dropout(x, 0.1, True)` and attention dropout in its
    graph) and a BatchNorm traced with torch.export: evaluate gives the eval-mode loss of one process
    and moves no running statistic; step still drops out and updates them."""
    from autoplan.graph.profile import model_fingerprint
    from autoplan.graph.trace import trace_model
    from autoplan.sources import parse_source

    gpt2_plan = _plan(GPT2_DROPOUT, 1)
    torch.manual_seed(0)
    net = _BatchNormNet()
    x, y = torch.randn(GLOBAL_BATCH, 3, 8, 8), torch.randint(0, 4, (GLOBAL_BATCH,))
    traced = trace_model(net, (x[:1],), tracer="export")
    assert any("batch_norm" in str(n.target) for n in traced.gm.graph.nodes)
    bn_plan = make_plan("bn-net", model_fingerprint(net), traced.block_names, pp=1, micro_batch_size=MICRO_BATCH,
                        num_microbatches=GLOBAL_BATCH // MICRO_BATCH, seq_len=SEQ)
    result = run_ranks(_traced_eval_job, 1, gpt2_plan, bn_plan, timeout_s=280, pg_timeout_s=100)[0]
    source = parse_source(GPT2_DROPOUT)
    model = source.build("cpu").eval()
    (ids, *_), target = source.batch(0, 0, GLOBAL_BATCH, SEQ, (GLOBAL_BATCH, SEQ, 64), torch.float32)
    chunks = GLOBAL_BATCH // MICRO_BATCH
    with torch.no_grad():
        expected = sum(float(source.loss_fn(model(i), t)) for i, t in zip(ids.chunk(chunks), target.chunk(chunks)))
    gpt2 = result["gpt2"]
    assert gpt2["evals"][0] == gpt2["evals"][1] == pytest.approx(expected / chunks, rel=1e-6), (gpt2, expected / chunks)
    assert gpt2["steps"][0] != gpt2["steps"][1], gpt2  # training still drops out
    net.eval()
    with torch.no_grad():
        expected = sum(float(nn.functional.cross_entropy(net(a), b)) for a, b in zip(x.chunk(chunks), y.chunk(chunks)))
    bn = result["bn"]
    assert bn["eval"] == pytest.approx(expected / chunks, rel=1e-6), (bn["eval"], expected / chunks)
    assert result["before"] and bn["unchanged"].keys() == result["before"].keys()
    for n, t in result["before"].items():
        assert torch.equal(bn["unchanged"][n], t), n
        assert not torch.equal(bn["stepped"][n], t), n  # a training step moves them
