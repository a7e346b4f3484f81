"""From a checked model to a served one: the Triton model repository (configs parsed with
Triton's own schema and checked against the model), and profiles from several targets
merged into one report."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner
from google.protobuf import text_format

from mha_onnx.cli import main
from mha_onnx.config import MhaConfig
from tests.paths import OPTIMUM

CFG = MhaConfig(d_model=32, num_heads=4, mask="key-padding", name="p")


@pytest.fixture(scope="module")
def model_config_pb2():
    """Triton's ModelConfig schema as tritonclient ships it (the module file is loaded alone:
    importing tritonclient.grpc would need the grpc extra)."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None or spec.origin is None:
        pytest.skip("tritonclient is not installed")
    path = Path(spec.origin).parent / "grpc" / "model_config_pb2.py"
    loader = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def _parse(pb2, path: Path):
    return text_format.Parse(path.read_text(), pb2.ModelConfig())


def _profile(export_cache, tmp_path) -> Path:
    result = CliRunner().invoke(main, ["profile", str(export_cache(CFG)), "--batch", "1,4",
                                       "--seq-lens", "8", "--iters", "2", "--threads", "1,2",
                                       "--no-ops", "--json"])
    assert result.exit_code == 0, result.output
    path = tmp_path / "profile.json"
    path.write_text(result.output[result.output.index("{"):])
    return path


def test_repository_for_three_targets(export_cache, tmp_path, model_config_pb2):
    src = export_cache(CFG)
    profile = _profile(export_cache, tmp_path)
    repo = tmp_path / "repo"
    args = ["package", str(src), "-o", str(repo), "--name", "mha", "--target", "cpu", "--target",
            "cuda", "--target", "tensorrt", "--instances", "2", "--from-profile", str(profile),
            "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    folder = repo / "mha"
    assert onnx.load(folder / "1" / "model.onnx").graph.node
    configs = {t: _parse(model_config_pb2, folder / "configs" / f"{t}.pbtxt")
               for t in ("cpu", "cuda", "tensorrt")}
    assert _parse(model_config_pb2, folder / "config.pbtxt") == configs["cpu"]
    for target, config in configs.items():
        assert config.backend == "onnxruntime" and config.max_batch_size == 8
        inputs = {i.name: i for i in config.input}
        assert list(inputs["query"].dims) == [-1, 32]  # batch left out, seq dynamic
        assert model_config_pb2.DataType.Name(inputs["query"].data_type) == "TYPE_FP32"
        assert model_config_pb2.DataType.Name(inputs["key_padding_mask"].data_type) == "TYPE_BOOL"
        assert list(config.output[0].dims) == [-1, 32]
        group = config.instance_group[0]
        assert group.count == 2
        kind = model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind)
        assert kind == ("KIND_CPU" if target == "cpu" else "KIND_GPU")
        assert list(config.dynamic_batching.preferred_batch_size) == [4]
        assert config.dynamic_batching.max_queue_delay_microseconds > 0
    trt = configs["tensorrt"].optimization.execution_accelerators.gpu_execution_accelerator[0]
    assert trt.name == "tensorrt" and trt.parameters["precision_mode"] == "FP16"
    assert trt.parameters["trt_profile_max_shapes"] == "query:8x2048x32,key_padding_mask:8x2048"
    assert configs["cpu"].parameters["intra_op_thread_count"].string_value in ("1", "2")
    readme = (folder / "README.md").read_text()
    assert "tritonserver --model-repository" in readme and "KServe" in readme
    again = CliRunner().invoke(main, args[:-1])
    assert again.exit_code == 2 and "not empty" in again.output


def test_a_model_that_needs_an_optimisation_level_says_so(export_cache, tmp_path,
                                                          model_config_pb2):
    from mha_onnx.graph import metadata

    model = onnx.load(export_cache(CFG))
    metadata.write(model, {"session": {"optimization": "extended"}})
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    result = CliRunner().invoke(main, ["package", str(path), "-o", str(tmp_path / "r"),
                                       "--max-batch-size", "0"])
    assert result.exit_code == 0, result.output
    config = _parse(model_config_pb2, tmp_path / "r" / "m" / "config.pbtxt")
    assert config.optimization.graph.level == 1 and config.max_batch_size == 0
    assert list(config.input[0].dims) == [-1, -1, 32]
    assert not config.HasField("dynamic_batching")


def test_report_merges_two_targets(export_cache, tmp_path):
    first = _profile(export_cache, tmp_path)
    data = json.loads(first.read_text())
    data["machine"] = {**data["machine"], "processor": "Other CPU", "isa": "AVX2", "cpus": 64}
    for point in data["points"]:
        point["p50_ms"] *= 0.5
    second = tmp_path / "other.json"
    second.write_text(json.dumps(data))
    out, plot = tmp_path / "report.md", tmp_path / "report.png"
    result = CliRunner().invoke(main, ["report", str(first), str(second), "-o", str(out),
                                       "--plot", str(plot), "--json"])
    assert result.exit_code == 0, result.output
    merged = json.loads(result.output)
    threads = {p["threads"] for p in data["points"]}  # every machine x thread count a column
    assert len(merged["targets"]) == 2 * len(threads) and len(merged["rows"]) == 2
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and " ms / " in line]
    assert "Other CPU (AVX2) x64 / cpu" in text and len(rows) == 2  # (ISA: one model name, two kernels)
    assert plot.read_bytes()[:4] == b"\x89PNG"
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({"points": []}))
    refused = CliRunner().invoke(main, ["report", str(stale), "-o", str(tmp_path / "x.md")])
    assert refused.exit_code == 2 and "schema" in refused.output


def test_report_keeps_a_forward_run_and_a_decode_step_apart(export_cache, tmp_path):
    """A profile of prompts and a --decode profile of the same model, batch and L: two
    rows (a forward run of L tokens, a step after L cached), never one merged row."""
    forward = _profile(export_cache, tmp_path)
    data = json.loads(forward.read_text())
    data["decode"] = True
    for point in data["points"]:
        point["p50_ms"] *= 0.1
    decode = tmp_path / "decode.json"
    decode.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["report", str(forward), str(decode), "-o",
                                       str(tmp_path / "r.md"), "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)["rows"]
    keys = {(p["batch"], p["seq_len"]) for p in data["points"]}
    assert sorted(r["run"] for r in rows) == ["decode step"] * len(keys) + ["forward"] * len(keys)
    assert all(len([k for k in r if " / cpu" in k]) == len({p["threads"] for p in
                                                             data["points"]}) for r in rows)


def test_a_shared_kv_cache_model_packages_its_scalar_length(export_cache, tmp_path,
                                                              model_config_pb2):
    """A scalar input (past_sequence_length of --kv-cache shared) is dims [1] reshaped to []:
    Triton's schema has no rank-0 dims."""
    src = export_cache(CFG.replace(mask="causal", kv_cache=True))
    shared = tmp_path / "kv.onnx"
    result = CliRunner().invoke(main, ["fuse", str(src), "-o", str(shared), "--kv-cache", "shared"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["package", str(shared), "-o", str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    config = _parse(model_config_pb2, tmp_path / "r" / "kv" / "config.pbtxt")
    length = next(i for i in config.input if i.name == "past_sequence_length")
    assert list(length.dims) == [1] and length.HasField("reshape")
    assert list(length.reshape.shape) == []
    assert model_config_pb2.DataType.Name(length.data_type) == "TYPE_INT64"


def test_report_keeps_every_thread_count_of_one_machine(export_cache, tmp_path):
    """Two profiles of one machine at 1 and 2 threads: two columns, nothing merged away."""
    first = _profile(export_cache, tmp_path)
    data = json.loads(first.read_text())
    for point in data["points"]:
        point["threads"] = 1 if point["threads"] != 1 else 2
        point["p50_ms"] *= 3  # slower: the old merge kept only the faster column
    second = tmp_path / "threads.json"
    second.write_text(json.dumps(data))
    result = CliRunner().invoke(main, ["report", str(first), str(second), "-o",
                                       str(tmp_path / "r.md"), "--json"])
    assert result.exit_code == 0, result.output
    merged = json.loads(result.output)
    assert len(merged["targets"]) == 2
    assert {t.rsplit(" / ", 1)[1] for t in merged["targets"]} == {"1 threads", "2 threads"}
    for row in merged["rows"]:
        assert all(row.get(t) for t in merged["targets"])


def test_report_keeps_two_models_of_one_name_apart_and_one_model_across_files(export_cache,
                                                                            tmp_path):
    """Two models both named model.onnx, each in a folder of its own (the layout export,
    fuse and quantize write): the report merged their rows into one and lost a model's
    numbers; it keeps them apart by their folders now, and still merges one model across
    two profiles (two machines)."""
    first = _profile(export_cache, tmp_path)
    data = json.loads(first.read_text())
    twice = [{**p, "model": f"/somewhere/{name}/model.onnx", "p50_ms": p["p50_ms"] * k}
             for name, k in (("llama", 1), ("llama-int4", 2)) for p in data["points"]]
    one, other = tmp_path / "one.json", tmp_path / "other.json"
    one.write_text(json.dumps({**data, "points": twice}))
    moved = [{**p, "model": p["model"].replace("/somewhere/", "/elsewhere/")} for p in twice]
    other.write_text(json.dumps({**data, "machine": {**data.get("machine", {}),
                                                      "hostname": "another"}, "points": moved}))
    result = CliRunner().invoke(main, ["report", str(one), str(other), "-o",
                                       str(tmp_path / "r.md"), "--json"])
    assert result.exit_code == 0, result.output
    merged = json.loads(result.output)
    assert {r["model"] for r in merged["rows"]} == {"llama/model.onnx", "llama-int4/model.onnx"}
    shapes = {(p["batch"], p["seq_len"]) for p in data["points"]}
    assert len(merged["rows"]) == 2 * len(shapes)  # (the two files' points in the same rows)


@pytest.mark.models
def test_package_says_what_a_deployment_must_know(tmp_path):
    """An Optimum GPT-2 (256 positions), fused and served stateless (the client sends the
    cache: a stateful decoder runs on the onnxruntime backend only): TensorRT gets a warning
    naming the ORT-only ops and a profile capped at the position table; a profile of one
    batch size sets no batching."""

    from mha_onnx.rewrite import fuse_file

    fused = tmp_path / "gpt2.onnx"
    fuse_file(OPTIMUM / "gpt2" / "model.onnx", fused)
    profile = tmp_path / "p.json"
    result = CliRunner().invoke(main, ["profile", str(fused), "--batch", "1", "--seq-lens", "16",
                                       "--iters", "2", "--no-ops", "--json"])
    assert result.exit_code == 0, result.output
    profile.write_text(result.output[result.output.index("{"):])
    result = CliRunner().invoke(main, ["package", str(fused), "-o", str(tmp_path / "repo"),
                                       "--target", "cpu", "--target", "tensorrt",
                                       "--stateless", "--from-profile", str(profile), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    notes = " ".join(report["notes"])
    assert "TensorRT builds no engine for" in notes and "GroupQueryAttention" in notes
    assert "lengths capped at 256" in notes and "measured one batch size" in notes
    assert report["batching"] == {}
    trt = (tmp_path / "repo" / "gpt2" / "configs" / "tensorrt.pbtxt").read_text()
    assert "input_ids:8x256" in trt and "x2048" not in trt
    assert "preferred_batch_size" not in (tmp_path / "repo" / "gpt2" / "config.pbtxt").read_text()


def test_an_openvino_target_for_tritons_openvino_backend(export_cache, tmp_path, model_config_pb2):
    """The OpenVINO backend's entry reads the same model.onnx; the model is compiled on
    OpenVINO first (one it cannot compile is refused with OpenVINO's reason, exit 3)."""
    pytest.importorskip("openvino")
    src = export_cache(CFG)
    result = CliRunner().invoke(main, ["package", str(src), "-o", str(tmp_path / "r"), "--name",
                                       "mha", "--target", "cpu", "--target", "openvino", "--json"])
    assert result.exit_code == 0, result.output
    config = _parse(model_config_pb2, tmp_path / "r" / "mha" / "configs" / "openvino.pbtxt")
    assert config.backend == "openvino" and config.default_model_filename == "model.onnx"
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(config.instance_group[0].kind) == "KIND_CPU"
    assert config.parameters["PERFORMANCE_HINT"].string_value == "LATENCY"
    assert "intra_op_thread_count" not in config.parameters  # an ORT setting, not OpenVINO's
    readme = (tmp_path / "r" / "mha" / "README.md").read_text()
    assert "onnxruntime backend, openvino backend" in readme

    from mha_onnx.rewrite import fuse_file

    fused = tmp_path / "ort.onnx"
    fuse_file(export_cache(CFG.replace(mask="causal")), fused)  # GQA without past
    refused = CliRunner().invoke(main, ["package", str(fused), "-o", str(tmp_path / "r2"),
                                        "--target", "openvino"])
    assert refused.exit_code == 3 and "GroupQueryAttention" in refused.output


def test_a_target_takes_a_model_of_its_own(export_cache, tmp_path, model_config_pb2):
    """--target-model cuda=M: that target's config loads M (default_model_filename), the
    others the model; a model with other inputs, or for a target not packaged, is refused."""
    src = export_cache(CFG)
    tuned = tmp_path / "tuned.onnx"
    assert CliRunner().invoke(main, ["fuse", str(src), "-o", str(tuned)]).exit_code == 0
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["package", str(src), "-o", str(repo), "--name", "m",
                                       "--target", "cpu", "--target", "cuda",
                                       "--target-model", f"cuda={tuned}"])
    assert result.exit_code == 0, result.output
    folder = repo / "m"
    cuda = _parse(model_config_pb2, folder / "configs" / "cuda.pbtxt")
    cpu = _parse(model_config_pb2, folder / "configs" / "cpu.pbtxt")
    assert cuda.default_model_filename == "model.cuda.onnx" and not cpu.default_model_filename
    assert (folder / "1" / "model.cuda.onnx").read_bytes() == tuned.read_bytes()
    assert "cuda: 1/model.cuda.onnx (not tuned)" in result.output
    assert "cuda loads `1/model.cuda.onnx`" in (folder / "README.md").read_text()
    other = export_cache(CFG.replace(mask="none"))
    for extra, says in ((["--target", "cuda", "--target-model", f"cuda={other}"],
                         "other inputs or outputs"),
                        (["--target-model", f"cuda={tuned}"], "which is not a --target"),
                        (["--target-model", "cuda"], "malformed --target-model")):
        bad = CliRunner().invoke(main, ["package", str(src), "-o", str(tmp_path / "r2"), *extra])
        assert bad.exit_code == 2 and says in bad.output, bad.output


@pytest.mark.parametrize("form", ["export", "appended", "shared"])
@pytest.mark.models
def test_a_kv_decoder_is_served_statefully_and_its_readme_runs(tmp_path, model_config_pb2,
                                                                form):
    """A decoder with a KV cache: sequence batching with one implicit state per past (the
    cache stays on the server), request inputs without the cache; the README's client loop,
    run as written against a stand-in for Triton (tests/triton_emulator.py), generates the
    tokens `mha-onnx generate` does."""
    from mha_onnx.generate import GenerationConfig, Generator
    from tests.rewrite.test_optimum import FIXTURES
    from tests.triton_emulator import Server, run_readme

    model = FIXTURES / "llama" / "model.onnx"
    if form != "export":
        model = tmp_path / f"{form}.onnx"
        result = CliRunner().invoke(main, ["fuse", str(FIXTURES / "llama" / "model.onnx"),
                                           "-o", str(model), "--kv-cache", form])
        assert result.exit_code == 0, result.output
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["package", str(model), "-o", str(repo), "--name", "lm",
                                       "--lengths", "1:64:64", "--json"])
    assert result.exit_code == 0, result.output
    config = _parse(model_config_pb2, repo / "lm" / "config.pbtxt")
    assert config.max_batch_size == 1 and config.sequence_batching.HasField("direct")
    states = config.sequence_batching.state
    assert [s.input_name for s in states] == [f"past_key_values.{n}.{k}" for n in range(2)
                                              for k in ("key", "value")]
    assert [i.name for i in config.input] == ["input_ids", "attention_mask", "position_ids"]
    assert [list(s.initial_state[0].dims) for s in states] == \
        [[2, 64 if form == "shared" else 1, 16]] * 4
    scope = run_readme(repo / "lm" / "README.md", Server(repo, "lm", model_config_pb2))
    with Generator(model) as generator:
        want = generator.generate([[1, 2, 3, 4, 5]], GenerationConfig(8, eos=())).sequences[0]
    assert scope["tokens"] == list(want)
    readme = (repo / "lm" / "README.md").read_text()
    assert "max batch size 1" in readme and "statefully" in readme


def test_a_stateless_models_readme_request_runs(export_cache, tmp_path, model_config_pb2):
    """The README's request of a model without a cache, as written, and the max batch size
    it says is the config's."""
    from tests.triton_emulator import Server, run_readme

    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["package", str(export_cache(CFG)), "-o", str(repo),
                                       "--name", "mha"])
    assert result.exit_code == 0, result.output
    scope = run_readme(repo / "mha" / "README.md", Server(repo, "mha", model_config_pb2))
    assert scope["result"].as_numpy("output").shape == (2, 16, 32)
    assert "max batch size 8." in (repo / "mha" / "README.md").read_text()


def test_a_decoder_cannot_go_to_tensorrt_statefully(tmp_path):
    from tests.rewrite.test_optimum import FIXTURES

    result = CliRunner().invoke(main, ["package", str(FIXTURES / "llama" / "model.onnx"), "-o",
                                       str(tmp_path / "repo"), "--target", "tensorrt"])
    assert result.exit_code == 2 and "onnxruntime backend only" in result.output
    assert not (tmp_path / "repo").exists()


def test_a_stateless_decoders_readme_request_runs(tmp_path, model_config_pb2):
    """`--stateless`: the request sends the cache; its sample shapes agree (a mask over past
    + new positions beside pasts of 16: 32), so it runs as written."""
    from tests.rewrite.test_optimum import FIXTURES
    from tests.triton_emulator import Server, run_readme

    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["package", str(FIXTURES / "llama" / "model.onnx"), "-o",
                                       str(repo), "--name", "lm", "--stateless"])
    assert result.exit_code == 0, result.output
    scope = run_readme(repo / "lm" / "README.md", Server(repo, "lm", model_config_pb2))
    assert scope["result"].as_numpy("present.0.key").shape == (2, 2, 32, 16)


def test_a_model_onnx_is_named_by_its_folder(tmp_path):
    """export, fuse and quantize write model.onnx into folders of their own: two such models
    were both packaged as "model"; by default a model.onnx is named by its folder now."""
    result = CliRunner().invoke(main, ["package", str(OPTIMUM / "llama" / "model.onnx"), "-o",
                                       str(tmp_path / "r")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r" / "llama" / "config.pbtxt").is_file()
    assert not (tmp_path / "r" / "model").exists()
    assert "dynamic batching: none (sequence batching" in result.output  # (it printed {})
