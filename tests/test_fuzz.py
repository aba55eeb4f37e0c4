"""Property-based fuzzing (hypothesis): the CLI never crashes, the planner never returns a bad plan.

CLI property, for every generated argv of `autoplan.cli.main`: the exit code is 0, 1 or 2, stderr
holds no traceback, and an exit 2 comes with exactly one line starting `autoplan: error:`. One
documented exception: argparse's own usage errors (a usage line, then `autoplan CMD: error: ...`).

Planner property: on random small ModelProfiles and clusters, `search_plans` either raises
PlanningError (a ValueError) or returns plans that all pass `autoplan.plan.validate`.

Nonsense property, for inputs the strategies know are nonsense (a model larger than any published
one, files nested deeper than any autoplan file, wrong types to the Python API): exit 2 with one line
(CLI), or ValueError / TypeError with a one-line message (API); never accepted.

Inputs stay cheap (tiny zoo models, small clusters). Generated CLI and API inputs per run: 2,170
(the `max_examples` below: 500 model specs, 250 cluster strings, 120 cluster YAML files, 150 pin
sets, 250 plan files, 100 suites, 250 nested files for 9 readers, 400 + 150 API calls), plus 150 planner
profiles; hypothesis runs each test to its `max_examples` (`--hypothesis-show-statistics` prints the
counts); about 20 s on 2 cores. Crashes fuzzing found are kept at the end as regression tests.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import time

import pytest
import yaml
from conftest import scaled_timeout_s
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from autoplan.cli import main

TINY = "gpt:num_layers=2,hidden_size=16,num_heads=2,vocab_size=32,max_seq_len=8"
TINY_ARGS = ["--global-batch", "4", "--seq-len", "8"]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
                database=None, derandomize=True)
_USAGE_ERROR = re.compile(r"^autoplan( [a-z]+)?: error: ")


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def check_cli(argv: list[str]) -> int:
    started = time.perf_counter()
    code, _, err = run_cli(argv)
    assert time.perf_counter() - started < scaled_timeout_s(20), argv  # no hang: every generated input ends in seconds
    assert code in (0, 1, 2), (argv, code, err[-2000:])
    assert "Traceback" not in err, (argv, err[-4000:])
    if code == 2:
        lines = err.strip().splitlines()
        if lines and lines[0].startswith("usage:"):  # argparse: usage, then "autoplan CMD: error: ..."
            assert _USAGE_ERROR.match(lines[-1]), (argv, err)
        elif argv and argv[0] == "run":  # the launcher's own one-line errors
            assert len(lines) == 1 and lines[0].startswith("autoplan: error:"), (argv, err)
        else:
            assert len(lines) == 1 and lines[0].startswith("autoplan: error:"), (argv, err)
    return code


# ---- strategies ------------------------------------------------------------------------------------

ZOO_KEYS = ["num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len", "num_kv_heads", "ffn_hidden_size",
            "tie_embeddings", "norm_eps", "rope_theta", "multiple_of", "dropout"]
weird_text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
small_ints = st.integers(-3, 9)
# Huge values only where they are refused cheaply; a huge dimension that used to crash is a regression
# test below; num_layers in the 1e5s is minutes of tracing, not a crash (docs/reliability.md).
values = st.one_of(small_ints.map(str), st.sampled_from(["0", "-1", "1e3", "nan", "inf", "true", "", "4.5", "0x10",
                                                         "9" * 40, "1_0", " 2", "٣", "1025", "65537", "1e400",
                                                         "99999999999999999999", "-inf", "9" * 5000]), weird_text)
pairs = st.lists(st.tuples(st.one_of(st.sampled_from(ZOO_KEYS), weird_text), values), max_size=6)
families = st.sampled_from(["gpt", "llama", "gpt2-small", "llama3-8b", "GPT", "nope", "", "gpt:", "x.py", "/tmp/nope.py"])


@st.composite
def model_specs(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return draw(weird_text)
    body = ",".join(f"{k}={v}" if draw(st.booleans()) else f"{k}{v}" for k, v in draw(pairs))
    sep = draw(st.sampled_from([":", "::", ";", ""]))
    return f"{draw(families)}{sep}{body}"


gpu_names = st.sampled_from(["H100-80GB", "A100-80GB", "A100-40GB", "cpu", "H100", "V100", "nope", "", "h100-80gb"])
counts = st.one_of(st.integers(-2, 4).map(str), st.sampled_from(["0", "x", "", "1.5", "٣", "99999999999999999999"]))


@st.composite
def cluster_strings(draw):
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(weird_text)
    if kind == 1:
        return draw(st.sampled_from(["dgx-h100", "4xdgx-a100", "dgx", "x", "xx", "1x", "1x1x", "0xdgx-h100", "-1xdgx-h100"]))
    return f"{draw(counts)}x{draw(counts)}x{draw(gpu_names)}"


yaml_scalars = st.one_of(st.none(), st.booleans(), small_ints, st.floats(allow_nan=True, allow_infinity=True),
                         weird_text, st.sampled_from(["H100-80GB", "A100-80GB", 1e30, -1, 0, 10**30]))
CLUSTER_KEYS = ["name", "nodes", "gpus_per_node", "gpu", "node_groups", "intra_node", "inter_node", "bandwidth_gbps",
                "latency_us", "count", "mem_gb", "peak_tflops"]
yaml_trees = st.recursive(
    yaml_scalars,
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(st.one_of(st.sampled_from(CLUSTER_KEYS), weird_text), children, max_size=4)),
    max_leaves=10)


# ---- CLI: model specs, clusters, YAML, pins --------------------------------------------------------


@settings(max_examples=500, **SETTINGS)
@given(spec=model_specs())
@example(spec="gpt:num_layers=2,hidden_size=16,num_heads=2")
@example(spec="llama:num_layers=1,hidden_size=8,num_heads=2,vocab_size=16,max_seq_len=4")
def test_cli_profile_survives_any_model_spec(spec):
    code = check_cli(["profile", "--model", spec, "--json", "--seq-len", "8"])
    if any(f"{key}={huge}" in spec for key in ZOO_KEYS for huge in ("1025", "65537", "99999999999999999999", "nan",
                                                                    "inf", "-inf", "1e400")):
        assert code == 2, spec  # larger than any published model, or not finite: refused


@pytest.mark.parametrize("key, value", [("num_layers", "1025"), ("num_layers", "99999999999999999999"),
                                        ("hidden_size", "65537"), ("vocab_size", str(2**20 + 1)),
                                        ("max_seq_len", str(2**24 + 1)), ("norm_eps", "nan"), ("norm_eps", "1"),
                                        ("num_heads", "1025"), ("ffn_hidden_size", str(2**18 + 2))])
def test_a_model_larger_than_any_published_is_refused_at_once(key, value):
    started = time.perf_counter()
    base = {"num_layers": "2", "hidden_size": "16", "num_heads": "2", key: value}
    spec = "gpt:" + ",".join(f"{k}={v}" for k, v in base.items())
    code, _, err = run_cli(["suggest", "--model", spec, "--cluster", "1x8xH100-80GB", "--global-batch", "8"])
    assert code == 2 and err.startswith("autoplan: error: value") and key in err, err
    assert time.perf_counter() - started < scaled_timeout_s(5)


@settings(max_examples=250, **SETTINGS)
@given(cluster=cluster_strings())
@example(cluster="1x2xH100-80GB")
def test_cli_suggest_survives_any_cluster_string(cluster):
    # --top 0 is refused after the model and cluster are parsed: the parse is fuzzed, not the search.
    check_cli(["suggest", "--model", TINY, "--cluster", cluster, *TINY_ARGS, "--top", "0"])


@settings(max_examples=120, **SETTINGS)
@given(tree=yaml_trees, raw=st.booleans(), text=weird_text)
def test_cli_suggest_survives_any_cluster_yaml(tmp_path, tree, raw, text):
    path = tmp_path / "cluster.yaml"
    path.write_text(text if raw else yaml.safe_dump(tree, allow_unicode=True))
    check_cli(["suggest", "--model", TINY, "--cluster", str(path), *TINY_ARGS, "--top", "0"])


pin_values = st.one_of(st.integers(-3, 5), st.sampled_from([0, -1]))


@settings(max_examples=150, **SETTINGS)
@given(pins=st.dictionaries(st.sampled_from(["--tp", "--pp", "--dp", "--micro-batch-size", "--virtual-stages"]),
                            pin_values, max_size=3),
       batch=st.sampled_from([-1, 0, 1, 3, 4]), seq=st.sampled_from([-8, 0, 1, 8]),
       top=st.sampled_from([-1, 0, 1, 2]))
def test_cli_suggest_survives_any_pins(pins, batch, seq, top):
    argv = ["suggest", "--model", TINY, "--cluster", "1x4xH100-80GB", "--global-batch", str(batch),
            "--seq-len", str(seq), "--top", str(top), "--json"]
    for flag, value in pins.items():
        argv += [flag, str(value)]
    check_cli(argv)


# ---- CLI: plan files -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    code, _, err = run_cli(["suggest", "--model", TINY, "--cluster", "1x2xH100-80GB", *TINY_ARGS, "--out", str(path),
                            "--json"])
    assert code == 0, err
    return path.read_text()


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), weird_text),
    lambda children: st.one_of(st.lists(children, max_size=3), st.dictionaries(weird_text, children, max_size=3)),
    max_leaves=8)


@st.composite
def plan_files(draw, valid: str):
    kind = draw(st.integers(0, 2))
    if kind == 0:  # arbitrary JSON or text
        return json.dumps(draw(json_values)) if draw(st.booleans()) else draw(weird_text)
    if kind == 1:  # truncated
        return valid[: draw(st.integers(0, len(valid) - 1))]
    data = json.loads(valid)  # wrong schema version, or a top-level field removed
    if draw(st.booleans()):
        data["schema_version"] = draw(st.one_of(st.sampled_from([0, 2, -1, "1", None, 1.0, [], {}]), json_values))
    else:
        del data[draw(st.sampled_from(sorted(data)))]
    return json.dumps(data)


@settings(max_examples=250, **SETTINGS)
@given(data=st.data(), command=st.sampled_from(["show", "export-torchtitan", "export-megatron", "export-deepspeed",
                                                "export-nope", "run"]))
def test_cli_plan_commands_survive_any_plan_file(tmp_path, plan_text, data, command):
    path = tmp_path / "plan.json"
    path.write_text(data.draw(plan_files(plan_text)))
    if command == "show":
        argv = ["show", str(path)]
    elif command == "run":  # --nproc 999 never matches: refused before any process starts
        argv = ["run", str(path), "--nproc", "999", "--steps", "1"]
    else:
        argv = ["export", str(path), "--to", command.split("-", 1)[1]]
    check_cli(argv)


# ---- CLI: suite files ------------------------------------------------------------------------------

case_values = st.one_of(yaml_scalars, st.sampled_from([TINY, "1x2xH100-80GB", "nope:x=1", "0x2xH100-80GB"]))
CASE_KEYS = ["name", "model", "cluster", "global_batch", "seq_len", "dtype", "pins", "extra"]


@st.composite
def suites(draw):
    kind = draw(st.integers(0, 2))
    if kind == 0:
        return draw(weird_text) if draw(st.booleans()) else yaml.safe_dump(draw(yaml_trees), allow_unicode=True)
    case = {"name": "c", "model": TINY, "cluster": "1x2xH100-80GB", "global_batch": 4, "seq_len": 8}
    for key in draw(st.lists(st.sampled_from(CASE_KEYS), max_size=2)):
        case[key] = draw(st.one_of(case_values, st.dictionaries(st.sampled_from(["tp", "pp", "zero", "x"]), case_values,
                                                                max_size=2)))
    suite = {"cases": [case] * draw(st.integers(0, 2))}
    if draw(st.booleans()):
        suite["tolerance"] = draw(st.dictionaries(st.sampled_from(["throughput", "memory", "search_time_s", "x"]),
                                                  yaml_scalars, max_size=2))
    return yaml.safe_dump(suite, allow_unicode=True)


@settings(max_examples=100, **SETTINGS)
@given(text=suites(), baseline=st.one_of(st.none(), weird_text, json_values.map(json.dumps)))
def test_cli_check_survives_any_suite_file(tmp_path, text, baseline):
    path = tmp_path / "suite.yaml"
    path.write_text(text)
    argv = ["check", str(path)]
    if baseline is not None:
        (tmp_path / "base.json").write_text(baseline)
        argv += ["--baseline", str(tmp_path / "base.json")]
    check_cli(argv)


# ---- nested and huge files, for every reader ---------------------------------------------------------

READERS = ["plan-show", "plan-export", "plan-run", "suite", "baseline", "trace", "cluster", "calibration", "hf-config"]


@st.composite
def nested_texts(draw):
    """(text, depth, block): JSON or YAML nested `depth` levels, in flow (`[[...]]`, `{"a": {...}}`)
    or YAML block style (`block`: not JSON at all)."""
    depth = draw(st.one_of(st.integers(1, 80), st.sampled_from([64, 65, 1000, 5000, 100_000])))
    style = draw(st.sampled_from(["list", "dict", "block", "mixed"]))
    if style == "list":
        return "[" * depth + "]" * depth, depth, False
    if style == "dict":
        return '{"a": ' * depth + "1" + "}" * depth, depth, False
    if style == "block":
        depth = min(depth, 3000)  # YAML block style: one indentation per level
        return "".join(" " * i + "k:\n" for i in range(depth)) + " " * depth + "1\n", depth, True
    return "[" + '{"x": [' * depth + "]}" * depth + "]", 2 * depth + 1, False


@settings(max_examples=250, **SETTINGS)
@given(nested=nested_texts(), reader=st.sampled_from(READERS))
def test_every_reader_refuses_nesting_deeper_than_any_autoplan_file_in_one_line(tmp_path, plan_text, nested, reader):
    text, depth, block = nested
    path = tmp_path / ("f.yaml" if reader in ("suite", "cluster") else "f.json")
    path.write_text(text)
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    if reader == "hf-config":
        (tmp_path / "config.json").write_text(text)
    argv = {"plan-show": ["show", str(path)], "plan-export": ["export", str(path), "--to", "megatron"],
            "plan-run": ["run", str(path), "--nproc", "999"], "suite": ["check", str(path)],
            "baseline": ["check", str(tmp_path / "suite.yaml"), "--baseline", str(path)],
            "trace": ["show", str(plan), "--trace", str(path)],
            "cluster": ["suggest", "--model", TINY, "--cluster", str(path), *TINY_ARGS, "--top", "0"],
            "calibration": ["suggest", "--model", TINY, "--cluster", "1x2xH100-80GB", *TINY_ARGS,
                            "--calibration", str(path)],
            "hf-config": ["profile", "--model", f"hf:{tmp_path / 'config.json'}"]}[reader]
    if reader == "baseline":
        (tmp_path / "suite.yaml").write_text(yaml.safe_dump({"cases": [{"name": "c", "model": TINY,
                                                                         "cluster": "1x2xH100-80GB", "global_batch": 4,
                                                                         "seq_len": 8}]}))
    code = check_cli(argv)
    assert code in (1, 2), (reader, depth, code)  # nothing nested is a valid file of any kind
    if depth > 64 and (not block or reader in ("suite", "cluster")):  # block style is YAML only
        _, _, err = run_cli(argv)
        assert code == 2 and "more than 64 levels deep" in err, (reader, depth, err[-300:])


# ---- the Python API: wrong types and values ----------------------------------------------------------

_WRONG = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), weird_text,
                   st.lists(st.integers(), max_size=2), st.dictionaries(weird_text, st.integers(), max_size=2),
                   st.sampled_from([object(), b"bytes", 1j, float("nan"), (1, 2)]))
_SUGGEST_ARGS = ["model", "cluster", "global_batch", "seq_len", "top", "dtype", "intra_node_bw_gbps", "tracer",
                 "leaf_modules", "calibration", "tp", "pp", "dp", "micro_batch_size", "schedule", "virtual_stages",
                 "recompute", "zero", "dp_replicate", "sequence_parallel", "example_inputs"]
_VALID = {"model": TINY, "cluster": "1x2xH100-80GB", "global_batch": 4, "seq_len": 8}


@settings(max_examples=400, **SETTINGS)
@given(function=st.sampled_from(["suggest", "profile", "parse_cluster", "partition", "Plan.load", "validate"]),
       argument=st.sampled_from(_SUGGEST_ARGS), value=_WRONG)
def test_the_api_answers_any_wrong_argument_in_one_line(function, argument, value):
    """A wrong type or value anywhere in the public API: ValueError or TypeError with one line,
    before any work that could hang; never AttributeError, KeyError, ZeroDivisionError, ..."""
    import autoplan

    kwargs = dict(_VALID)
    if function == "suggest":
        kwargs[argument] = value
        call = lambda: autoplan.suggest(**kwargs)  # noqa: E731
    elif function == "profile":
        key = {"global_batch": "batch_size", "cluster": "device", "top": "dtype"}.get(argument, argument)
        if key not in ("model", "batch_size", "seq_len", "dtype", "device", "tracer", "leaf_modules",
                       "example_inputs"):
            key = "seq_len"
        call = lambda: autoplan.profile(**{"model": TINY, "seq_len": 8, key: value})  # noqa: E731
    elif function == "parse_cluster":
        call = lambda: autoplan.parse_cluster(value)  # noqa: E731
    elif function == "partition":
        call = lambda: autoplan.partition(TINY, value)  # noqa: E731
    elif function == "validate":
        call = lambda: autoplan.validate(value)  # noqa: E731
    else:
        call = lambda: autoplan.Plan.load(value)  # noqa: E731
    started = time.perf_counter()
    try:
        result = call()
    except (ValueError, TypeError) as exc:
        message = str(exc).strip()
        assert message and len(message.splitlines()) == 1, (function, argument, value, message)
        if not message.startswith("the model rejects"):  # the model's own words about inputs it was given
            assert "object has no attribute" not in message and "not supported between" not in message, message
    else:
        assert function in ("suggest", "profile") and result, (function, argument, value)
        # Accepted only where the generated value happens to be a valid one: None (the default), a
        # flag, an integer in range, a number, a list (of no leaf modules).
        assert value is None or isinstance(value, bool | int | float | list), (function, argument, value)
    assert time.perf_counter() - started < scaled_timeout_s(20)


# ---- planner -------------------------------------------------------------------------------------


@st.composite
def profiles(draw):
    from autoplan.graph.blocks import Block, CrossingTensor, CutCandidate, ModelProfile

    n = draw(st.integers(1, 7))
    kinds = ["embedding", *draw(st.lists(st.sampled_from(["layer", "attention", "mlp", "norm", "other"]),
                                         min_size=max(0, n - 2), max_size=max(0, n - 2))), "head"][:n]
    big = st.one_of(st.integers(0, 10**6), st.sampled_from([0, 1, 10**12, 10**15]))
    blocks = []
    for i, kind in enumerate(kinds):
        # FLOPs >= 1 here; a profile whose every block is free is its own regression test below.
        fwd = draw(st.one_of(st.floats(1.0, 1e15), st.sampled_from([1.0, 1e18])))
        blocks.append(Block(
            name=f"b{i}", kind=kind, fwd_flops=fwd, bwd_flops=2 * fwd, num_params=draw(big), param_bytes=draw(big),
            output_bytes=draw(big), saved_bytes=draw(big), tp_comm_bytes=draw(st.integers(0, 10**6)),
            fwd_time_s=draw(st.one_of(st.none(), st.floats(1e-6, 1.0))), bwd_time_s=None))
    cuts = []
    for i in range(n - 1):
        legal = draw(st.integers(0, 5)) > 0
        tensor = CrossingTensor(name=f"t{i}", shape=(1, 8, 16), dtype="bfloat16", num_bytes=blocks[i].output_bytes)
        cuts.append(CutCandidate(index=i, tensors=(tensor,), legal=legal, reason="" if legal else "non-tensor"))
    heads = draw(st.sampled_from([None, 1, 2, 3, 4, 8]))
    return ModelProfile(model_name="fuzz", fingerprint="f" * 16, blocks=tuple(blocks), cuts=tuple(cuts),
                        batch_size=draw(st.sampled_from([1, 2])), seq_len=8, dtype="bfloat16", tracer="fx",
                        num_heads=heads, num_kv_heads=heads, hidden_size=16, vocab_size=32, num_layers=max(1, n - 2))


@settings(max_examples=150, **SETTINGS)
@given(profile=profiles(), nodes=st.integers(1, 2), gpus=st.sampled_from([1, 2, 3, 4, 8]),
       gpu=st.sampled_from(["H100-80GB", "A100-40GB"]), batch=st.sampled_from([1, 2, 3, 4, 8, 12]),
       pins=st.dictionaries(st.sampled_from(["tp", "pp", "dp", "micro_batch_size"]), st.integers(-1, 4), max_size=2))
def test_planner_returns_valid_plans_or_a_planning_error(profile, nodes, gpus, gpu, batch, pins):
    from autoplan.cluster import parse_cluster
    from autoplan.plan import Job, validate
    from autoplan.search.space import PlanningError, search_plans

    cluster = parse_cluster(f"{nodes}x{gpus}x{gpu}")
    job = Job(global_batch=batch, seq_len=8, dtype="bfloat16")
    try:
        result = search_plans(profile, cluster, job, model_spec="fuzz", top=3, pins=pins)
    except PlanningError:
        return
    assert result.plans
    for plan in result.plans:
        assert validate(plan) == [], (validate(plan), plan.to_dict())


# ---- crashes fuzzing found (fixed; kept as regression tests) ------------------------------------


def test_cli_profile_huge_hidden_size_is_a_one_line_error():
    code, _, err = run_cli(["profile", "--model", "gpt:num_layers=2,hidden_size=1000000000000,num_heads=2,"
                                                  "vocab_size=32,max_seq_len=8", "--json"])
    assert code == 2 and err.strip().startswith("autoplan: error:") and "Traceback" not in err, err[-600:]



# Nested fields of the wrong type pass Plan.from_dict unchecked and crash later (TypeError or
# AttributeError with a traceback, exit 1). Owner: plan.py (Plan.from_dict / validate). One case
# per crash site found by fuzzing; the full list is in the reliability report.
_NESTED = [("stages", "first_block", "x", "run"), ("stages", "end_block", None, "export"),
           ("stages", "num_params", "x", "show"), ("job", "seq_len", None, "show"),
           ("predicted", "breakdown", -1, "show"), ("predicted", "peak_memory_bytes", "x", "export"),
           ("predicted", "mfu", None, "export")]


@pytest.mark.parametrize(("target", "key", "value", "command"), _NESTED)
def test_cli_plan_with_a_nested_field_of_the_wrong_type_is_a_one_line_error(tmp_path, plan_text, target, key, value,
                                                                            command):
    data = json.loads(plan_text)
    (data[target][0] if target == "stages" else data[target])[key] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    argv = {"show": ["show", str(path)], "export": ["export", str(path), "--to", "megatron"],
            "run": ["run", str(path), "--nproc", "999"]}[command]
    assert check_cli(argv) == 2


def test_planner_on_a_free_model_raises_planning_error_not_zero_division():
    from autoplan.cluster import parse_cluster
    from autoplan.graph.blocks import Block, CutCandidate, ModelProfile
    from autoplan.plan import Job
    from autoplan.search.space import PlanningError, search_plans

    blocks = tuple(Block(name=f"b{i}", kind=k, fwd_flops=0.0, bwd_flops=0.0, num_params=0, param_bytes=0,
                         output_bytes=0, saved_bytes=0) for i, k in enumerate(["embedding", "head"]))
    profile = ModelProfile(model_name="free", fingerprint="f" * 16, blocks=blocks, cuts=(CutCandidate(0, ()),),
                           batch_size=1, seq_len=8, dtype="bfloat16", tracer="fx")
    with contextlib.suppress(PlanningError):
        search_plans(profile, parse_cluster("1x1xH100-80GB"), Job(global_batch=1, seq_len=8), model_spec="free")


@pytest.mark.parametrize("argv", [
    ["suggest", "--cluster", "99999999x8xH100-80GB"],
    ["suggest", "--global-batch", "999999999"],
    ["suggest", "--tp", "8", "--pp", "999999"],
])
def test_cli_huge_values_are_refused_quickly(argv):
    started = time.perf_counter()
    code, _, err = run_cli(argv)
    assert code == 2 and err.strip().startswith("autoplan: error:"), err[-600:]
    assert time.perf_counter() - started < scaled_timeout_s(60)


# ---- nonsense once accepted with exit 0 (issue "Faults and hostile input"): now one line, exit 2 ----


@pytest.mark.parametrize("extra, words", [
    (["--virtual-stages", "3"], "virtual_stages=3"),          # was dropped silently (no interleaved plan fits)
    (["--intra-node-bw", "inf"], "intra_node_bw_gbps must be a finite number"),
    (["--inter-node-bw", "nan"], "inter_node_bw_gbps must be a finite number"),
    (["--intra-node-bw", "0"], "intra_node_bw_gbps must be a finite number"),
    (["--out", ""], "--out is empty"),
    (["--out", "/nonexistent-dir/p.json"], "does not exist; create it first"),
])
def test_suggest_refuses_what_it_once_dropped_or_accepted(extra, words):
    code, _, err = run_cli(["suggest", "--model", TINY, "--cluster", "1x4xH100-80GB", *TINY_ARGS, *extra])
    assert code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("field, value, words", [(("job", "seq_len"), 0, "job.seq_len = 0"),
                                                 (("job", "dtype"), "int8", "job.dtype 'int8'"),
                                                 (("job", "global_batch"), 2**40, "job.global_batch"),
                                                 (("job", "seq_len"), True, "job.seq_len")])
@pytest.mark.parametrize("command", ["show", "export", "run"])
def test_plan_commands_refuse_a_job_no_model_runs(tmp_path, plan_text, field, value, words, command):
    data = json.loads(plan_text)
    data[field[0]][field[1]] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    argv = {"show": ["show", str(path)], "export": ["export", str(path), "--to", "megatron"],
            "run": ["run", str(path), "--steps", "1"]}[command]
    code, _, err = run_cli(argv)
    assert code == 2 and err.count("\n") == 1 and words in err, err


def test_a_spec_with_a_non_finite_float_is_refused():
    code, _, err = run_cli(["profile", "--model", TINY + ",norm_eps=nan"])
    assert code == 2 and "norm_eps must be a finite number" in err, err


# ---- issue 29: bad input that still got through, now one line, exit 2 --------------------------------


@pytest.mark.parametrize("spec, words", [
    ("hf:llama:num_hidden_layers=-1", "num_hidden_layers=-1 must be at least 1"),  # was "0.26B parameters, 1 blocks"
    ("hf:llama:hidden_size=0", "hidden_size=0 must be at least 1"),
    ("hf:gpt2:n_head=-2", "n_head=-2 must be at least 1"),
    ("hf:llama:intermediate_size=-1", "intermediate_size=-1 must be at least 1"),
    ("hf:llama:vocab_size=1", "vocab_size=1 must be at least 2"),
    (TINY.replace("vocab_size=32", "vocab_size=1"), "vocab_size must be at least 2"),  # was accepted
    ("llama3-8b:num_layers=0", "num_layers must be positive"),
    ("mixtral-8x7b:ffn_hidden_size=-1", "ffn_hidden_size must be positive"),
])
def test_suggest_refuses_a_model_size_no_model_can_have(spec, words):
    started = time.perf_counter()
    code, _, err = run_cli(["suggest", "--model", spec, "--cluster", "1x2xH100-80GB", *TINY_ARGS])
    assert code == 2 and err.count("\n") == 1 and err.startswith("autoplan: error:") and words in err, err
    assert time.perf_counter() - started < scaled_timeout_s(10)


# (path into the plan's JSON, the value written there, words the refusal must hold)
_EDITED_NUMBERS = [
    (("job", "seq_len"), 10**9, "job.global_batch x job.seq_len = 4 x 1,000,000,000"),  # show accepted it
    (("stages", 0, "memory", "weights_bytes"), -1e9, "stages[0].memory.weights_bytes = -1000000000.0"),
    (("predicted", "peak_memory_bytes"), -1.0, "predicted.peak_memory_bytes = -1.0"),  # run exited 0
    (("predicted", "step_time_s"), -0.5, "predicted.step_time_s = -0.5"),
    (("predicted", "tokens_per_s"), 1.0, "the job or the prediction was edited"),
    (("predicted", "bubble_fraction"), 1.5, "bubble_fraction = 1.5 must be below 1"),
    (("predicted", "breakdown", "compute_s"), -1.0, "predicted.breakdown['compute_s'] = -1.0"),
    (("stages", 0, "fwd_time_s"), -1.0, "stages[0].fwd_time_s = -1.0"),
    (("stages", 0, "num_params"), -5, "stages[0].num_params = -5"),
    (("stages", 0, "memory", "activations_bytes"), 1e15, "memory figures edited"),
]


@pytest.mark.parametrize(("path", "value", "words"), _EDITED_NUMBERS)
@pytest.mark.parametrize("command", ["show", "export", "run"])
def test_plan_commands_refuse_numbers_no_search_writes(tmp_path, plan_text, path, value, words, command):
    data = json.loads(plan_text)
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    file = tmp_path / "plan.json"
    file.write_text(json.dumps(data))
    argv = {"show": ["show", str(file)], "export": ["export", str(file), "--to", "megatron"],
            "run": ["run", str(file), "--steps", "1"]}[command]
    code, _, err = run_cli(argv)
    assert code == 2 and err.count("\n") == 1 and words in err and "re-create it with `autoplan suggest" in err, err


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("1f1b", 2), ("interleaved-1f1b", 1)])
def test_export_refuses_a_schedule_its_plan_cannot_build(tmp_path, plan_text, schedule, virtual_stages):
    """`export` wrote these (`show` and `run` refused them when building the schedule)."""
    data = json.loads(plan_text)
    data["schedule"], data["virtual_stages"] = schedule, virtual_stages
    if virtual_stages == 2:  # as many stages as pp * virtual_stages, so only the schedule is wrong
        first, second = (dict(data["stages"][0]) for _ in range(2))
        first.update(index=0, pp_rank=0, end_block=1)
        second.update(index=1, pp_rank=0, first_block=1, end_block=len(data["block_names"]))
        data["stages"] = [first, second]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, _, err = run_cli(["export", str(path), "--to", "megatron"])
    assert code == 2 and err.count("\n") == 1 and f"schedule '{schedule}'" in err, err


@pytest.mark.parametrize("value", [None, [], {}])
def test_a_plan_whose_cluster_curve_holds_no_number_is_one_line(tmp_path, plan_text, value):
    """float(None) in Cluster.from_dict was a TypeError with a traceback from show and export."""
    data = json.loads(plan_text)
    curves = data["cluster"]["intra_node"]["curves"]
    curves[sorted(curves)[0]][0][0] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    for argv in (["show", str(path)], ["export", str(path), "--to", "megatron"]):
        code, _, err = run_cli(argv)
        assert code == 2 and err.count("\n") == 1 and "plan.cluster is malformed" in err, err


LLAMA = "llama:num_layers=4,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16"


@pytest.mark.parametrize("extra", [
    ["--zero", "3", "--dp-replicate", "2"],
    ["--cp", "2"],
    ["--pp", "2", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"],
    ["--model", "moe:num_layers=2,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16,num_experts=4,"
                "experts_per_token=2", "--ep", "2"],
])
def test_plans_of_every_kind_pass_the_checks_on_load(tmp_path, extra):
    """The numbers checked on load are the ones the search writes, for every parallelism it plans."""
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["suggest", "--model", LLAMA, "--cluster", "1x8xH100-80GB", "--global-batch", "16",
                            "--seq-len", "16", *extra, "--top", "1", "--out", str(out)])
    assert code == 0, err
    assert run_cli(["show", str(out)])[0] == 0


# ---- issue 29, item 11: what a fuzz of the cluster, aux-loss, partition, run and calibrate entries found ----


@pytest.mark.parametrize("curve, words", [
    ("[[null, 1]]", "point 0 must be [bytes, bytes_per_s]"),    # was TypeError: float() argument ... 'NoneType'
    ("[[1, 2, 3]]", "point 0 must be [bytes, bytes_per_s]"),
    ("[[1, 2], 5]", "point 1 must be [bytes, bytes_per_s]"),
    ("[[1, .inf]]", "two finite numbers > 0"),
    ("7", "must be a list of [bytes, bytes_per_s] points"),
    ("[]", "has no points"),
])
def test_a_cluster_yaml_link_curve_that_is_not_points_is_one_line(tmp_path, curve, words):
    path = tmp_path / "c.yaml"
    path.write_text("groups:\n  - {nodes: 1, gpus_per_node: 2, gpu: H100-SXM-80GB}\n"
                    f"intra_node: {{bw_gbps: 450, latency_us: 2, curves: {{all_reduce: {curve}}}}}\n")
    code, _, err = run_cli(["suggest", "--model", TINY, "--cluster", str(path), *TINY_ARGS])
    assert code == 2 and err.count("\n") == 1, err
    assert "intra_node: link curve 'all_reduce'" in err and words in err, err


@pytest.mark.parametrize("link, words", [
    ("{bw_gbps: .inf}", "bw_gbps must be a positive number of at most 100000"),   # was priced as a free link
    ("{bw_gbps: 1e300}", "bw_gbps must be a positive number of at most 100000"),
    ("{latency_us: 5e6}", "latency_us must be a number >= 0 and at most 1e+06"),
])
def test_a_cluster_yaml_link_no_machine_has_is_one_line(tmp_path, link, words):
    path = tmp_path / "c.yaml"
    path.write_text(f"groups:\n  - {{nodes: 2, gpus_per_node: 2, gpu: H100-SXM-80GB}}\ninter_node: {link}\n")
    code, _, err = run_cli(["suggest", "--model", TINY, "--cluster", str(path), *TINY_ARGS])
    assert code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("argv, words", [
    (["run", "PLAN", "--model", ""], "--model '' is empty"),            # ran the plan's model silently
    (["run", "PLAN", "--model", " "], "leave --model out"),
    (["run", "PLAN", "--timeout", "1e9"], "--timeout 1e+09 is more than 1e+06 s"),
    (["calibrate", "--out", "OUT", "--timeout", "-1"], "--timeout -1 must be a number of seconds above 0"),  # accepted
    (["calibrate", "--out", "OUT", "--timeout", "0"], "--timeout 0 must be a number of seconds above 0"),
    (["calibrate", "--out", "OUT", "--timeout", "nan"], "--timeout nan must be"),
    (["calibrate", "--out", "OUT", "--collectives", "--nproc", "1000000"], "CPU cores; pass --nproc"),
    (["calibrate", "--out", "", "--quick"], "--out is empty"),
    (["calibrate", "--out", "OUT", "--dtype", ""], "--dtype is empty"),
])
def test_run_and_calibrate_refuse_what_they_once_accepted(tmp_path, plan_text, argv, words):
    plan = tmp_path / "plan.json"
    plan.write_text(plan_text)
    out = tmp_path / "cal.json"
    argv = [{"PLAN": str(plan), "OUT": str(out)}.get(a, a) for a in argv]
    if argv[0] == "calibrate":
        argv += ["--device", "cpu"]
    started = time.perf_counter()
    code, _, err = run_cli(argv)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert time.perf_counter() - started < scaled_timeout_s(10) and not out.exists()  # refused before anything ran


def _more_api_call(function: str, argument: str, value, plan_path: str):
    """A call of `function` with `value` for `argument` and valid values elsewhere, arranged so that
    a call whose every argument is valid still stops before any work (a sentinel mistake checked last)."""
    import torch

    import autoplan
    from autoplan.calibrate.calibrate import calibrate
    from autoplan.runtime.launcher.launch import run_plan

    if function == "attach_aux_loss":
        args = {"output": torch.zeros(2), "aux": torch.tensor(1.0, requires_grad=True)}
        args["output" if argument in ("model", "cluster", "global_batch") else "aux"] = value
        return lambda: autoplan.attach_aux_loss(**args)
    if function == "aux_loss_scale":
        return lambda: autoplan.aux_loss_scale(value).__enter__()
    if function == "partition":  # all valid: this two-rank plan has no process group (PartitionError)
        key = {"model": "example_inputs", "cluster": "device", "global_batch": "seed", "seq_len": "timeout",
               "top": "loss_fn", "dtype": "example_target", "tracer": "tracer"}.get(argument, "leaf_modules")
        return lambda: autoplan.partition(TINY, plan_path, **{key: value})
    if function == "run_plan":  # all valid: the fault spec is refused last, before spawning
        key = {"model": "model", "cluster": "nproc", "global_batch": "steps", "seq_len": "timeout_s", "top": "seed",
               "dtype": "metrics_path", "tracer": "data", "leaf_modules": "checkpoint_dir"}.get(argument, "lr")
        return lambda: run_plan(plan_path, _fault="not-a-fault", **{key: value})
    if function == "calibrate":  # all valid: the output's directory does not exist
        key = {"model": "device", "cluster": "gpu", "global_batch": "nproc", "seq_len": "timeout_s",
               "top": "quick", "dtype": "dtype", "tracer": "force"}.get(argument, "collectives")
        return lambda: calibrate("/nonexistent-dir/cal.json", **{key: value})
    from autoplan.cluster import Cluster  # a link field of a cluster mapping

    key = {"model": "bw_gbps", "cluster": "latency_us", "global_batch": "kind", "seq_len": "bw_bytes_per_s",
           "top": "latency_s"}.get(argument, "curves")
    link = {key: value} if key != "curves" else {"curves": {"p2p": [[1, 1], value]}}
    return lambda: Cluster.from_dict({"nodes": 2, "gpus_per_node": 2, "gpu": "H100-80GB", "inter_node": link})


@settings(max_examples=150, **SETTINGS)
@given(function=st.sampled_from(["attach_aux_loss", "aux_loss_scale", "partition", "run_plan", "calibrate",
                                 "Cluster.from_dict"]),
       argument=st.sampled_from(_SUGGEST_ARGS), value=_WRONG)
def test_more_of_the_api_answers_any_wrong_argument_in_one_line(tmp_path, plan_text, function, argument, value):
    """The same property as above for the entries a fuzz of issue 29 found tracebacks in: a wrong
    type or value is ValueError or TypeError with one line (attach_aux_loss(1, aux) was returned
    silently, attach_aux_loss(out, 1) an AttributeError, partition(device=1.5) a multi-line TypeError)."""
    plan = tmp_path / "plan.json"
    if not plan.exists():
        plan.write_text(plan_text)
    call = _more_api_call(function, argument, value, str(plan))
    started = time.perf_counter()
    try:
        call()
    except (ValueError, TypeError) as exc:
        message = str(exc).strip()
        assert message and len(message.splitlines()) == 1, (function, argument, value, message)
        if not message.startswith("the model rejects"):  # the model's own words about inputs it was given
            for raw in ("object has no attribute", "not supported between", "argument must be", "not iterable"):
                assert raw not in message, (function, argument, value, message)
    else:
        # Accepted only where the value is a valid one: a scale, a link figure, a curve point.
        assert function in ("aux_loss_scale", "Cluster.from_dict"), (function, argument, value)
    assert time.perf_counter() - started < scaled_timeout_s(20)
