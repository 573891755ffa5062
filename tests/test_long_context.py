"""Long prompts on the CPU backends: chunked prefill and the prefix cache, from the recipe to the HTTP answer.

- The recipe fields and their checks (one line naming the field, at validate time).
- The reference model's `extend` continuing a prefill chunk by chunk against transformers (every family).
- Built bundles of every family (export backend, one build per run): a prompt several times the largest bucket
  gives transformers' greedy tokens; a warm request (an exact repeat, a shared prefix with another tail) gives the
  cold request's tokens and logits bit for bit; a small checkpoint budget evicts and stays correct; a request that
  does not fit is refused before any work; `qbuild serve` answers a prompt of 8x the largest bucket and answers its
  repeat from the cache, saying so in `usage`; `make demo`'s requests (demo/serve_client.py) to such a server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qbuild import backends
from qbuild.core.errors import UserError
from qbuild.model.chunking import LongContext, PrefixCacheSpec, extend_buckets, pieces
from qbuild.model.tinymodel import SPECIAL_TOKENS, VOCAB_SIZE
from tests.conftest import REPO, qbuild

TEXT_TOKENS = VOCAB_SIZE - len(SPECIAL_TOKENS)   # ordinary ids, below the special tokens
LOGITS_ATOL = 1e-4   # float32 tiny models against transformers: our summation orders differ from HF's


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TEXT_TOKENS, (n,), generator=gen).tolist()


# --- the recipe ----------------------------------------------------------------------------------------------------

RECIPE = """\
model: {{hf: Qwen/Qwen3.5-27B}}
parallel: {{tp: 4}}
dtype: bfloat16
backend: export
text:
  seq_len: {seq_len}
  cte_buckets: [256, 512]
{extra}
"""

REFUSED = {
    # name: (the text section's extra lines, what the one line must say)
    "cache-without-chunking": ("  prefix_cache: {block_size: 256}",
                               "text.prefix_cache: needs text.chunked_prefill"),
    "chunk-not-a-bucket": ("  chunked_prefill: {chunk_size: 384}",
                           "text.chunked_prefill.chunk_size: 384 is not one of the context-encoding buckets"),
    "kv-not-whole-chunks": ("  tkg_buckets: [4000]\n  chunked_prefill: {chunk_size: 512}",
                            "text.tkg_buckets: the KV length 4000 is not a multiple of the prefill chunk 512"),
    "block-not-dividing-kv": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 3000}",
                              "text.prefix_cache.block_size: 3000 does not divide the KV length 4096"),
    "checkpoint-off-block": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 256, checkpoint_interval: 384}",
                             "text.prefix_cache.checkpoint_interval: 384 is not a multiple of block_size 256"),
    "checkpoint-off-chunk": ("  chunked_prefill: {chunk_size: 512}\n"
                             "  prefix_cache: {block_size: 128, checkpoint_interval: 768}",
                             "text.prefix_cache.checkpoint_interval: 768 and the prefill chunk 512: one must be a "
                             "multiple of the other"),
    "too-few-blocks": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 256, num_blocks: 15}",
                       "text.prefix_cache.num_blocks: 15 blocks of 256 tokens hold less than 1 sequence(s) of "
                       "seq_len 4096; give at least 16"),
    "blocks-over-device-memory": ("  chunked_prefill: {}\n  prefix_cache: {block_size: 256, num_blocks: 200000}",
                                  "text.prefix_cache.num_blocks: 200000 KV blocks of 256 tokens and 8 DeltaNet "
                                  "checkpoint slots need"),
    "slots-not-positive": ("  chunked_prefill: {}\n  prefix_cache: {checkpoint_slots: 0}",
                           "text.prefix_cache.checkpoint_slots"),
}


def _validate(tmp_path: Path, name: str, extra: str, seq_len: int = 4096):
    from qbuild.planning.plan import validate_recipe
    from qbuild.recipe.schema import load_recipe
    from qbuild.hub.source import load_arch

    f = tmp_path / f"{name}.yaml"
    f.write_text(RECIPE.format(seq_len=seq_len, extra=extra))
    loaded = load_recipe(f)
    validate_recipe(loaded, load_arch(loaded), backends)
    return loaded, f


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_each_impossible_setting_is_one_line_naming_its_field(tmp_path, case):
    extra, needle = REFUSED[case]
    with pytest.raises(UserError) as err:
        _validate(tmp_path, case, extra)
    message = str(err.value)
    assert "\n" not in message and needle in message and f"{case}.yaml:" in message, message


def test_a_refused_setting_exits_2_in_one_line_through_the_cli(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(RECIPE.format(seq_len=4096, extra="  chunked_prefill: {chunk_size: 384}"))
    proc = qbuild("recipe", "validate", str(f), cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "text.chunked_prefill.chunk_size: 384" in proc.stderr


def test_defaults_follow_the_port_and_the_cpu_plan_compiles_the_extend_graphs_it_needs(tmp_path):
    """Chunk: the largest bucket; blocks: one sequence (the port's --num-gpu-blocks-override default); checkpoints
    every block, 8 slots (the port's defaults). A checkpoint interval below the chunk makes it the piece size."""
    from qbuild.backends.cpu.backend import long_context, text_graphs

    loaded, _ = _validate(tmp_path, "ok", "  chunked_prefill: {}\n  prefix_cache: {}")
    assert long_context(loaded) == LongContext(512, PrefixCacheSpec(256, 16, 256, 8))
    assert long_context(loaded).step == 256
    assert text_graphs(loaded) == [("cte", 256), ("cte", 512), ("tkg", 4096), ("extend", 4096)]
    loaded, _ = _validate(tmp_path, "plain", "")
    assert long_context(loaded) is None and ("extend", 4096) not in text_graphs(loaded)


def test_the_shipped_128k_recipe_turns_both_on_as_the_port_does():
    from qbuild.recipe.schema import load_recipe

    t = load_recipe(REPO / "recipes" / "36-27b-fp8-128k.yaml").recipe.text
    assert (t.chunk_size, t.prefix_cache.block_size, t.checkpoint_interval, t.prefix_cache.checkpoint_slots) == \
        (512, 256, 256, 8)
    assert t.num_blocks == 131072 // 256


def test_verify_prompts_may_exceed_the_largest_bucket_with_chunked_prefill(tmp_path):
    """Without chunked prefill a verify prompt must fit the largest CTE bucket; with it, the KV length."""
    base = RECIPE.replace("[256, 512]", "[4]").replace("Qwen3.5-27B}}", "Qwen3.5-27B}}\nverify: {{new_tokens: 4}}")
    (tmp_path / "a.yaml").write_text(base.format(seq_len=64, extra=""))
    from qbuild.planning.plan import validate_recipe
    from qbuild.recipe.schema import load_recipe
    from qbuild.hub.source import load_arch

    loaded = load_recipe(tmp_path / "a.yaml")
    with pytest.raises(UserError, match="verify prompt"):
        validate_recipe(loaded, load_arch(loaded), backends)
    (tmp_path / "b.yaml").write_text(base.format(seq_len=64, extra="  chunked_prefill: {}"))
    loaded = load_recipe(tmp_path / "b.yaml")
    validate_recipe(loaded, load_arch(loaded), backends)


# --- where prompts are cut -----------------------------------------------------------------------------------------

def test_pieces_lie_on_a_fixed_grid_and_extend_graphs_cover_every_later_piece():
    assert pieces(5, 16) == [(0, 5)]
    assert pieces(40, 16) == [(0, 16), (16, 32), (32, 40)]
    # A later piece needs `step` slots from its start: in KV buckets [48, 128] the piece at 32 needs 48, the one
    # at 48 needs 64 -> 128.
    assert extend_buckets(16, [48, 128]) == [48, 128]
    assert extend_buckets(16, [16, 128]) == [128]


# --- the reference model -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_extend_continues_a_prefill_chunk_by_chunk_as_transformers_runs_the_whole_prompt(tiny_checkpoints, family):
    """The first chunk through `prefill`, then `extend` chunks of 32 (the last one right-padded) from the state:
    the logits of every position are transformers' of the whole prompt (tp 2, three DeltaNet layers and an
    attention layer)."""
    import transformers
    from safetensors.torch import load_file

    from qbuild.model.arch import arch_from_config
    from qbuild.model.convert.convert import convert_state_dict
    from qbuild.model.convert.shard import shard_state_dict
    from qbuild.model.ranks import RankLayout
    from qbuild.model.modeling import TextModel, text_position_ids

    path = tiny_checkpoints[family]
    config = json.loads((path / "config.json").read_text())
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    text, _ = convert_state_dict(config, tensors, dtype="float32")
    shards = shard_state_dict(config, text, ranks=RankLayout.split(2, 1))
    first, model = (TextModel(arch_from_config(config), tp=2, max_seq_len=L).eval() for L in (32, 160))
    first.load_shards(shards)
    model.load_shards(shards)
    prompt = torch.tensor(_prompt(150, seed=1))
    with torch.no_grad():
        logits, state = first.prefill(prompt[None, :32], text_position_ids(32), torch.tensor([32]))
        outs, state = [logits[0]], [torch.nn.functional.pad(s, (0, 0, 0, 128)) if s.ndim == 5 and s.shape[3] == 32
                                    else s for s in state]
        for start in range(32, 150, 32):
            real = min(32, 150 - start)
            ids = torch.cat([prompt[start:start + real], prompt[-1:].expand(32 - real)])[None]
            logits, state = model.extend(ids, text_position_ids(32, offset=start), torch.tensor([start]),
                                         torch.tensor([real]), state)
            outs.append(logits[0, :real])
        auto = (transformers.AutoModelForCausalLM if family == "qwen3_next"
                else transformers.AutoModelForImageTextToText)
        hf = auto.from_pretrained(path, dtype=torch.float32).eval()
        expected = hf(input_ids=prompt[None]).logits[0]
    assert (torch.cat(outs) - expected).abs().max().item() < LOGITS_ATOL


# --- built bundles -------------------------------------------------------------------------------------------------

# One bundle per family, export backend, float32. Every prompt is cut into pieces of 16 tokens (the smallest of
# chunk and checkpoint interval), so prompts of a few hundred tokens are many pieces; the verify step runs the golden
# prompts (and the dense VL's image prompt) through the same pieces.
BUNDLES = {
    # family: (recipe lines)
    "qwen3_next": ("parallel: {tp: 1}\n"
                   "text: {seq_len: 160, cte_buckets: [16], chunked_prefill: {chunk_size: 16},\n"
                   "       prefix_cache: {block_size: 16, checkpoint_interval: 16, checkpoint_slots: 3}}\n"),
    "qwen3_5": ("parallel: {tp: 2}\nvision: {buckets: [64]}\n"
                "text: {seq_len: 160, cte_buckets: [16, 32], chunked_prefill: {chunk_size: 32},\n"
                "       prefix_cache: {block_size: 8, checkpoint_interval: 16, checkpoint_slots: 3}}\n"),
    "qwen3_5_moe": ("parallel: {tp: 2, ep: 2}\n"
                    "text: {seq_len: 160, cte_buckets: [16], chunked_prefill: {chunk_size: 16},\n"
                    "       prefix_cache: {block_size: 16, checkpoint_interval: 32, checkpoint_slots: 3}}\n"),
}
LARGEST_BUCKET = {"qwen3_next": 16, "qwen3_5": 32, "qwen3_5_moe": 16}


@pytest.fixture(scope="session")
def project(tmp_path_factory, small_checkpoints) -> Path:
    """The three recipes built and verified into one store (`qbuild compile`), once per run."""
    root = tmp_path_factory.mktemp("long-context")
    for family, lines in BUNDLES.items():
        (root / "recipes").mkdir(exist_ok=True)
        (root / "recipes" / f"lc-{family}.yaml").write_text(
            f"model: {{path: {small_checkpoints[family]}}}\nbackend: export\ndtype: float32\n{lines}"
            "verify: {top1_min: 0.99, token_match_min: 1.0, max_logit_err: 0.001, new_tokens: 4}\n")
    proc = qbuild("compile", "--all", "-j", "2", "--store", str(root / "store"), cwd=root,
                  env={"QBUILD_STORE": "", "XDG_CACHE_HOME": str(root / "xdg"), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


@pytest.fixture(scope="session")
def bundles(project, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for family in BUNDLES:
        out[family] = tmp_path_factory.mktemp("lc-bundle") / family
        qbuild("pull", f"lc-{family}", "--to", str(out[family]), "--store", str(project / "store"), cwd=project,
               check=True)
    return out


@pytest.fixture(scope="session")
def runtimes(bundles):
    from qbuild.model.runtime import Runtime

    return {family: Runtime.load(path) for family, path in bundles.items()}


def _transformers(small_checkpoints, family: str):
    import transformers

    auto = transformers.AutoModelForCausalLM if family == "qwen3_next" else transformers.AutoModelForImageTextToText
    return auto.from_pretrained(small_checkpoints[family], dtype=torch.float32).eval()


def built(test):
    """A test of the built bundles: slow, and in the xdist group that builds them once."""
    return pytest.mark.slow(pytest.mark.xdist_group("long-context")(test))


@built
@pytest.mark.parametrize("family", sorted(BUNDLES))
def test_a_prompt_several_times_the_largest_bucket_gives_transformers_greedy_tokens(runtimes, small_checkpoints,
                                                                                     family):
    runtime = runtimes[family]
    n = 133   # 8.3 and 4.2 times the largest bucket (16, or 32 for the VL bundle), past a block boundary
    prompt = _prompt(n, seed=2)
    gen = runtime.generate(prompt, 8, use_cache=False)
    hf = _transformers(small_checkpoints, family)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, n:].tolist()
        logits = hf(input_ids=torch.tensor([prompt])).logits[0]
    assert gen.token_ids == expected[:len(gen.token_ids)] and gen.token_ids   # a run may stop early at EOS
    assert gen.cached_tokens == 0 and (gen.prefill_logits - logits).abs().max().item() < LOGITS_ATOL


@built
@pytest.mark.parametrize("family", sorted(BUNDLES))
def test_warm_requests_give_the_cold_requests_tokens_bit_for_bit(runtimes, family):
    """An exact repeat resumes at the deepest checkpoint before its last token; a prompt sharing a prefix with a
    cached one and going on differently resumes inside the shared part. Both are what the same prompt gives with
    the cache off: the same tokens, and the same logits to the bit for every position they compute."""
    runtime = runtimes[family]
    runtime.prefix_cache.clear()
    interval = runtime.prefix_cache.spec.checkpoint_interval
    prompt = _prompt(100, seed=3)
    cold = runtime.generate(prompt, 6, stop_at_eos=False)
    warm = runtime.generate(prompt, 6, stop_at_eos=False)
    assert cold.cached_tokens == 0 and warm.cached_tokens == 99 // interval * interval
    assert warm.token_ids == cold.token_ids
    assert torch.equal(warm.prefill_logits, cold.prefill_logits[warm.cached_tokens:])
    shared = prompt[:70] + _prompt(40, seed=4)
    resumed = runtime.generate(shared, 6, stop_at_eos=False)
    alone = runtime.generate(shared, 6, stop_at_eos=False, use_cache=False)
    assert resumed.cached_tokens == 70 // interval * interval > 0
    assert resumed.token_ids == alone.token_ids
    assert torch.equal(resumed.prefill_logits, alone.prefill_logits[resumed.cached_tokens:])


@built
def test_a_small_checkpoint_budget_evicts_and_stays_correct(runtimes):
    """Three slots, and prompts of up to six checkpoints each, interleaved: entries are evicted (some prompts find
    nothing to resume), and every answer is the uncached one."""
    runtime = runtimes["qwen3_next"]
    runtime.prefix_cache.clear()
    prompts = [_prompt(96, seed=10), _prompt(40, seed=11), _prompt(96, seed=10)[:50] + _prompt(20, seed=12)]
    answers = {}
    for i in [0, 1, 2, 0, 2, 1, 0]:
        gen = runtime.generate(prompts[i], 3, stop_at_eos=False)
        answers.setdefault(i, runtime.generate(prompts[i], 3, stop_at_eos=False, use_cache=False).token_ids)
        assert gen.token_ids == answers[i], i
    stats = runtime.prefix_cache.stats
    assert stats.evicted_checkpoints > 0 and stats.checkpoints == 3 and stats.hits > 0
    assert stats.peak_bytes <= stats.budget_bytes


@built
def test_a_tiled_image_is_part_of_the_cached_prefix(runtimes, tmp_path):
    """An image larger than the bundle's largest vision bucket (128 patches, bucket 64) runs as 2x2 tiles; its stitched
    features key the first block as a whole image's do: a repeat resumes with the cold tokens, and an image that
    differs only in its bottom right corner resumes nothing."""
    from PIL import Image

    runtime = runtimes["qwen3_5"]
    runtime.prefix_cache.clear()
    first, second = tmp_path / "a.png", tmp_path / "b.png"
    Image.new("RGB", (128, 256), (30, 160, 90)).save(first)
    corner = Image.new("RGB", (128, 256), (30, 160, 90))
    corner.paste((250, 250, 250), (96, 224, 128, 256))
    corner.save(second)
    plan = runtime.prepare_image(first).plan
    assert (plan.bucket, plan.tiled) == (64, True)
    text = _prompt(40, seed=6)
    cold = runtime.generate(text, 4, image=first, stop_at_eos=False)
    warm = runtime.generate(text, 4, image=first, stop_at_eos=False)
    other = runtime.generate(text, 4, image=second, stop_at_eos=False)
    assert warm.cached_tokens > 0 and warm.token_ids == cold.token_ids
    assert other.cached_tokens == 0
    assert other.token_ids == runtime.generate(text, 4, image=second, stop_at_eos=False, use_cache=False).token_ids


@built
def test_an_image_is_part_of_the_cached_prefix(runtimes, tmp_path):
    """The VL bundle's image prompt: its image tokens span the first two pieces; a repeat resumes, and the same text
    with another image resumes nothing (the image's features key the first block)."""
    from PIL import Image

    runtime = runtimes["qwen3_5"]
    runtime.prefix_cache.clear()
    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    Image.new("RGB", (96, 64), (200, 20, 20)).save(red)
    Image.new("RGB", (96, 64), (20, 20, 200)).save(blue)
    text = _prompt(40, seed=5)
    cold = runtime.generate(text, 4, image=red, stop_at_eos=False)
    assert len(cold.prompt_ids) > 32   # image tokens + text: more than the largest bucket
    warm = runtime.generate(text, 4, image=red, stop_at_eos=False)
    other = runtime.generate(text, 4, image=blue, stop_at_eos=False)
    assert warm.cached_tokens > 0 and warm.token_ids == cold.token_ids
    assert other.cached_tokens == 0
    assert other.token_ids == runtime.generate(text, 4, image=blue, stop_at_eos=False, use_cache=False).token_ids


@built
def test_a_request_that_does_not_fit_is_refused_before_any_work(runtimes):
    from qbuild.backends.openai_server.serve import Generator, RequestError

    runtime = runtimes["qwen3_5_moe"]
    calls = []
    real_graph = runtime.graph
    runtime.graph = lambda name: calls.append(name) or real_graph(name)
    try:
        gen = Generator(runtime, "lc")
        with pytest.raises(RequestError) as err:
            gen.new_tokens(161, None, 16, "max_tokens")
        assert err.value.status == 400 and "more than the 160 KV slots" in str(err.value)
        with pytest.raises(RequestError) as err:
            gen.new_tokens(150, 20, 16, "max_tokens")
        assert err.value.param == "max_tokens" and "needs 169 KV slots" in str(err.value)
        assert gen.new_tokens(150, None, 16, "max_tokens") == 11   # the rest of the cache, past the CTE bucket
        with pytest.raises(UserError):
            runtime.generate(_prompt(161, seed=0), 1)
    finally:
        del runtime.graph
    assert calls == []


@built
def test_serve_answers_8x_the_largest_bucket_and_its_repeat_from_the_cache(bundles, small_checkpoints, tmp_path):
    import openai

    from tests.test_serve import start

    family = "qwen3_next"
    n = 8 * LARGEST_BUCKET[family]
    prompt = _prompt(n, seed=6)
    hf = _transformers(small_checkpoints, family)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, n:].tolist()
    import transformers

    text = transformers.AutoTokenizer.from_pretrained(small_checkpoints[family]).decode(expected,
                                                                                     skip_special_tokens=True)
    bundle = Path(shutil.copytree(bundles[family], tmp_path / "bundle"))
    server = start(str(bundle), tmp_path)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        assert client.models.list().data[0].model_extra["max_prompt_tokens"] == 160
        cold = client.completions.create(model="bundle", prompt=prompt, max_tokens=6)
        warm = client.completions.create(model="bundle", prompt=prompt, max_tokens=6)
        assert cold.choices[0].text == warm.choices[0].text
        assert text.startswith(cold.choices[0].text) and cold.choices[0].text   # a run may stop early at EOS
        assert cold.usage.prompt_tokens == warm.usage.prompt_tokens == n
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert warm.usage.prompt_tokens_details.cached_tokens == n - 16
    finally:
        code, err = server.stop()
    assert code == 0, err




@built
def test_the_demos_requests_a_long_prompt_cold_and_warm_and_an_image_chat(bundles, runtimes, small_checkpoints,
                                                                          tmp_path):
    """`make demo`'s last step (demo/serve_client.py) against a served long-prompt VL bundle (the dense one: vision
    and a prefix cache): the long prompt's repeat resumes at its deepest checkpoint before its last token and chooses
    the cold token, the image chat answers, each line printed and the JSON document written for `qbuild report
    --serve`; the report shows it."""
    from tests.test_serve import start

    bundle = Path(shutil.copytree(bundles["qwen3_5"], tmp_path / "bundle"))
    server = start(str(bundle), tmp_path)
    try:
        proc = subprocess.run([sys.executable, str(REPO / "demo" / "serve_client.py"), server.url, "--out",
                               str(tmp_path / "serve.json")], capture_output=True, text=True, timeout=300)
    finally:
        code, err = server.stop()
    assert proc.returncode == 0 and code == 0, proc.stderr + err
    doc = json.loads((tmp_path / "serve.json").read_text())
    n = 160 * 7 // 8     # of the 160-token KV cache
    interval = runtimes["qwen3_5"].prefix_cache.spec.checkpoint_interval
    assert doc["long_prompt"]["tokens"] == n and doc["long_prompt"]["same_answer"] is True
    assert doc["long_prompt"]["cold_cached_tokens"] == 0
    assert doc["long_prompt"]["warm_cached_tokens"] == (n - 1) // interval * interval
    assert doc["image"]["prompt_tokens"] > 20 and doc["image"]["completion_tokens"] > 0
    lines = proc.stdout.splitlines()
    assert lines[1].startswith(f"  a prompt of {n} tokens, cold: ") and lines[1].endswith("cached_tokens 0")
    assert f"cached_tokens {(n - 1) // interval * interval} (" in lines[2] and "the same token" in lines[2]
    assert lines[3].startswith("  an image of 128x96 pixels and 'What is in this picture?': ")
    (tmp_path / "plain.yaml").write_text(f"model: {{path: {small_checkpoints['qwen3_5']}}}\nbackend: export\n"
                                         "dtype: float32\ntext: {seq_len: 48, cte_buckets: [32]}\n")
    shown = qbuild("report", "plain.yaml", "--serve", "serve.json", "--out", "r.html", "--json", cwd=tmp_path)
    assert shown.returncode == 0 and json.loads(shown.stdout)["serve"] == 1, shown.stderr
    assert 'data-request="warm"' in (tmp_path / "r.html").read_text()


@built
def test_qbuild_bench_measures_prefill_not_the_cache(runtimes):
    """`qbuild bench` runs one prompt several times: each run is prefilled, none answered from the prefix cache."""
    from qbuild.model.runtime.bench import bench

    runtime = runtimes["qwen3_next"]
    runtime.prefix_cache.clear()
    hits = runtime.prefix_cache.stats.hits
    points = bench(runtime, repeats=2, warmup=1, new_tokens=2, lengths=[16])
    assert points[0].prompt_len == 16 and runtime.prefix_cache.stats.hits == hits
    assert runtime.prefix_cache.stats.checkpoints == 0


def test_serve_dry_run_names_the_long_prompt_limit_and_the_cache(tmp_path):
    """Read from bundle.json alone: with chunked prefill a prompt may fill the KV cache, and the cache is named."""
    from qbuild.backends.base import ServeOptions
    from qbuild.backends.cpu.serving import CpuServer

    manifest = {"family": "qwen3_5", "backend": "export", "tp": 1, "ep": 1, "batch_size": 1, "seq_len": 256,
                "dtype": "float32", "buckets": {"cte": [32], "tkg": [256], "vision": []}, "graphs": {},
                "long_context": {"chunk_size": 32, "prefix_cache": {"block_size": 16, "num_blocks": 16,
                                                                    "checkpoint_interval": 32, "checkpoint_slots": 8}}}
    options = ServeOptions(name="tiny", host="127.0.0.1", port=9001, log=print, on_ready=print)
    doc = CpuServer("export").serve_command(tmp_path, manifest, options)
    assert doc["max_prompt_tokens"] == 256 and doc["max_model_len"] == 256
    assert doc["long_context"] == manifest["long_context"]
