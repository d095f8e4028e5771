"""The GPU tier: on a CUDA device, what the CPU tests check in Triton's interpreter and on the CPU.

Every test here is marked `gpu`: collected everywhere, skipped without CUDA with one reason (tests/conftest.py).
`python -m pytest -m gpu` runs them alone; `python -m benchmarks.device_check` runs them first.

1. The Triton kernels compiled for the device (TRITON_INTERPRET unset) against their torch references, on the
   random cases tests/test_kernels.py draws: the distillation loss and its gradient, greedy and sampled
   verification; and the quantized matmul (int8 per row, grouped int8, int4) on tests/test_quant.py's shapes.
2. The same kernels at bf16, at the sizes training and serving meet (default blocks, a 128k vocabulary).
3. EAGLE-3 training on CUDA (the conftest tiny Llama, tests/test_ddp.py's recipe): the same rows, and the first
   steps' losses of the CPU's fp32 run, within LOSS_MATCH[precision].
4. Speculative decoding on CUDA: greedy output token for token target-only decoding, with a random drafter
   (nothing accepted) and tests/test_engine.py's oracle (partial acceptance: both caches rolled back), one
   prompt at a time and batched.
5. `python train.py ... trainer=gpu trainer.devices=1` end to end: training, export and the closing report.

Tolerances: the loss and gradients of the distillation kernels as tests/test_kernels.py's (every path computes in
fp32 and differs in summation order; compiled Triton rounds to bf16 as torch does); verification exactly, except
sampling at 128k columns, where the draw's CDF sums in another order and may land on a neighbour (accepted
counts stay exact). tl.dot multiplies fp32 in TF32 on NVIDIA GPUs (Triton's default), so the quantized matmul is
held to the bound that rounding gives, 2^-10 x sum_k |x_k w_k| (fp32 x) and 2^-7 (bf16 x: the reference rounds W
to bf16), against a float64 product.
"""

import json
import random
import subprocess
import sys

import lightning as L
import pytest
import torch
from conftest import FAMILIES, LAYER_IDS, VOCAB_SIZE
from test_cli import REPO, run_train
from test_ddp import DRAFT, GLOBAL_BATCH, SEQ_LEN, Record, corpus
from test_dflash import make_dflash
from test_dspark import make_dspark
from test_engine import MAX_NEW, OracleDrafter, check_stats, prompts_of, wrong_positions
from test_hidden_cache import data_file  # noqa: F401 (a fixture)
from test_kernels import BLOCK, GRAD_TOL, LOSS_TOL, greedy_case, loss_and_grad, loss_case, verify_case

import forge_kernels as kernels
from forge_kernels import (
    distill_loss,
    distill_loss_reference,
    distill_loss_triton,
    quant_matmul,
    quant_matmul_triton,
    verify_greedy,
    verify_greedy_reference,
    verify_greedy_triton,
    verify_sampling_reference,
    verify_sampling_triton,
)
from forge_kernels.quant_matmul import dequantize, pack_int4, round_to_nearest_int4
from inference.drafting import DraftingConfig
from inference.engine import generate, generate_batch
from speculators import draft_vocab
from speculators.eagle3 import Eagle3Config, Eagle3Drafter
from speculators.target import FrozenTarget, TargetConfig
from train.data import DataConfig, TextDataModule
from train.module import DrafterModule
from train.optim import OptimConfig
from train.recipes import TrainerConfig
from train.trainer import fit, make_trainer

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
QUANT_SHAPES = [(48, 64, 32), (32, 256, 64), (20, 96, 32), (33, 128, 16), (16, 32, 32)]  # tests/test_quant.py's
TF32_BOUND = {torch.float32: 2**-10, torch.bfloat16: 2**-7}  # of sum_k |x_k w_k|, see the module doc
TRAIN_STEPS = 4
LOSS_MATCH = {"32-true": 1e-3, "bf16-mixed": 1e-2}  # relative, per step, against the CPU's fp32 run (here: 0, 1.4e-4)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    assert not kernels.INTERPRET, "unset TRITON_INTERPRET: this tier checks the kernels compiled for the GPU"


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def weight_on(device, weight: tuple) -> tuple:
    """(qweight, scales, zeros, group_size) with its tensors on `device`."""
    return tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in weight)


# --- 1. the compiled kernels against their references ------------------------------------------------


@pytest.mark.parametrize("block", [BLOCK, None])  # None: the kernels' own default block
@pytest.mark.parametrize("seed", range(24))
def test_distill_loss_kernel_matches_reference(seed, block):
    z, t, draft_to_target, mask, kind, shift = loss_case(seed)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed))
    expected, expected_grad = loss_and_grad(distill_loss_reference, z, t, draft_to_target, mask, kind, shift, weights)
    kw = {} if block is None else {"block": block}
    loss, grad = loss_and_grad(distill_loss_triton, *on(CUDA, z, t, draft_to_target, mask), kind, shift,
                               weights.to(CUDA), **kw)
    assert loss.dtype == torch.float32 and grad.dtype == z.dtype and grad.device.type == CUDA.type
    torch.testing.assert_close(loss.cpu(), expected, **LOSS_TOL)
    torch.testing.assert_close(grad.cpu(), expected_grad, **GRAD_TOL[z.dtype])
    # The dispatch rule sends CUDA tensors to the kernel.
    torch.testing.assert_close(distill_loss(*on(CUDA, z, t, draft_to_target, mask), kind=kind, shift=shift).cpu(),
                               expected, **LOSS_TOL)


@pytest.mark.parametrize("block", [BLOCK, None])
@pytest.mark.parametrize("seed", range(16))
def test_verify_greedy_kernel_matches_reference(seed, block):
    drafts, logits = greedy_case(seed)
    kw = {} if block is None else {"block": block}
    got = verify_greedy_triton(*on(CUDA, drafts, logits), **kw)
    expected = verify_greedy_reference(drafts, logits)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected)), (got, expected)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(verify_greedy(*on(CUDA, drafts, logits)), expected))


@pytest.mark.parametrize("block", [BLOCK, None])
@pytest.mark.parametrize("seed", range(16))
def test_verify_sampling_kernel_matches_reference(seed, block):
    drafts, draft_probs, logits, uniform = verify_case(seed)
    temperature = random.Random(seed).choice([0.5, 1.0, 1.7])
    kw = {} if block is None else {"block": block}
    got = verify_sampling_triton(*on(CUDA, drafts, draft_probs, logits), temperature, uniform.to(CUDA), **kw)
    expected = verify_sampling_reference(drafts, draft_probs, logits, temperature, uniform)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected)), (got, expected)


def quantized_weight(scheme: str, N: int, K: int, group: int, seed: int = 0):
    """(qweight, scales, zeros, group_size) in kernels.quant_matmul's format."""
    gen = torch.Generator().manual_seed(seed)
    if scheme == "int8":
        return torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen), torch.rand(N, generator=gen) / 64, None, None
    if scheme == "grouped_int8":
        q = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=gen)
        return q, torch.rand(N, K // group, generator=gen) / 64, None, group
    q, scales, zeros = round_to_nearest_int4(torch.randn(N, K, generator=gen), group)
    return pack_int4(q), scales, zeros, group


def assert_within_tf32(got: torch.Tensor, x: torch.Tensor, weight) -> None:
    """|got - x W^T| <= bound x sum_k |x_k w_k|, the product in float64 (module doc)."""
    w = dequantize(*weight).double()
    exact, scale = x.double() @ w.T, x.double().abs() @ w.abs().T
    error = (got.double().cpu() - exact).abs()
    assert bool((error <= TF32_BOUND[x.dtype] * scale + 1e-6).all()), float((error / (scale + 1e-12)).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("N, K, group", QUANT_SHAPES)
@pytest.mark.parametrize("scheme", ["int8", "grouped_int8", "int4"])
def test_quant_matmul_kernel_matches_reference(scheme, N, K, group, rows, dtype):
    weight = quantized_weight(scheme, N, K, group)
    x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = quant_matmul_triton(x.to(CUDA), *weight_on(CUDA, weight))
    assert got.dtype == dtype and got.shape == (rows, N)
    assert_within_tf32(got, x, weight)
    dispatched = quant_matmul(x.to(CUDA), *weight_on(CUDA, weight))
    assert torch.equal(dispatched, got)  # the rule picks the kernel on CUDA


# --- 2. bf16 at the sizes training and serving meet ----------------------------------------------------


@pytest.mark.parametrize("kind", ["soft_ce", "kl"])
def test_distill_loss_kernel_at_bf16_and_a_128k_vocabulary(kind):
    """A 32,768-token draft vocabulary of a 128,256-token target, bf16 logits, the default block of 2048."""
    gen = torch.Generator().manual_seed(0)
    T, D, V, shift = 48, 32768, 128256, 2
    z = torch.randn(2, T, D, generator=gen).mul_(3).bfloat16()
    t = torch.randn(2, T, V, generator=gen).mul_(3).bfloat16()
    draft_to_target = torch.randperm(V, generator=gen)[:D].sort().values
    mask = torch.rand(2, T, generator=gen) < 0.7
    weights = torch.randn(2, T, generator=gen)
    expected, expected_grad = loss_and_grad(distill_loss_reference, z, t, draft_to_target, mask, kind, shift, weights)
    loss, grad = loss_and_grad(distill_loss, *on(CUDA, z, t, draft_to_target, mask), kind, shift, weights.to(CUDA))
    torch.testing.assert_close(loss.cpu(), expected, atol=1e-4, rtol=1e-4)  # 32k-term sums in another order
    torch.testing.assert_close(grad.cpu(), expected_grad, **GRAD_TOL[torch.bfloat16])


def test_verification_kernels_at_bf16_and_a_128k_vocabulary():
    gen = torch.Generator().manual_seed(0)
    B, K, V = 64, 5, 128256
    logits = torch.randn(B, K + 1, V, generator=gen).mul_(4).bfloat16()
    keep = torch.rand(B, K, generator=gen) < 0.8  # mostly the target's argmax: every accepted length occurs
    drafts = torch.where(keep, logits.argmax(-1)[:, :-1], torch.randint(0, V, (B, K), generator=gen))
    got = verify_greedy(*on(CUDA, drafts, logits))
    expected = verify_greedy_reference(drafts, logits)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(got, expected))
    q = torch.softmax(logits[:, :K].float() + torch.randn(B, K, V, generator=gen), -1)
    uniform = torch.rand(B, K + 1, generator=gen)
    accepted, token = verify_sampling_triton(*on(CUDA, drafts, q, logits), 1.0, uniform.to(CUDA))
    ref_accepted, ref_token = verify_sampling_reference(drafts, q, logits, 1.0, uniform)
    assert torch.equal(accepted.cpu(), ref_accepted)
    assert (token.cpu() == ref_token).float().mean() >= 0.9, "the draws differ beyond the CDF's rounding"


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quant_matmul_kernel_at_bf16_and_model_sizes(scheme):
    """SmolLM2-135M's MLP (576 -> 1536) over a training batch of 2,048 rows, and its lm_head (49,152 rows) over 6."""
    for rows, N, K in ((2048, 1536, 576), (6, 49152, 576)):
        weight = quantized_weight(scheme, N, K, 32, seed=rows)
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(N)).bfloat16()
        got = quant_matmul(x.to(CUDA), *weight_on(CUDA, weight))
        assert_within_tf32(got, x, weight)


# --- 3. training on CUDA ---------------------------------------------------------------------------------


def train(target_dir, accelerator: str, precision: str, run_dir) -> Record:
    """tests/test_ddp.py's one-process training, on `accelerator` in `precision`."""
    L.seed_everything(0)
    target = FrozenTarget.load(TargetConfig(name_or_path=str(target_dir), layer_ids=LAYER_IDS))
    data = TextDataModule(DataConfig(seq_len=SEQ_LEN, batch_size=GLOBAL_BATCH, max_val_sequences=2), corpus(),
                          target.tokenizer, seed=0)
    data.setup("fit")
    counts = draft_vocab.count_tokens(data.train_rows, data.train_mask, target.vocab_size)
    drafter = Eagle3Drafter.from_target(Eagle3Config(depth=2, draft_vocab_size=DRAFT), target, counts)
    module = DrafterModule(drafter, target, OptimConfig(lr=1e-2, warmup_steps=2), max_steps=6)
    record = Record()
    cfg = TrainerConfig(max_steps=TRAIN_STEPS, accelerator=accelerator, precision=precision, val_every_n_steps=1000,
                        checkpoint_every_n_steps=TRAIN_STEPS, progress_bar=False)
    fit(make_trainer(cfg, False, run_dir, [record]), module, data, None)
    return record


@pytest.fixture(scope="module")
def cpu_run(llama_dir, tmp_path_factory) -> Record:
    return train(llama_dir, "cpu", "32-true", tmp_path_factory.mktemp("cpu"))


@pytest.mark.parametrize("precision", list(LOSS_MATCH))
def test_training_on_cuda_matches_the_cpu(precision, cpu_run, llama_dir, tmp_path):
    gpu_run = train(llama_dir, "gpu", precision, tmp_path)
    steps = range(1, TRAIN_STEPS + 1)
    assert all(gpu_run.rows[s] == cpu_run.rows[s] for s in steps)  # the same batches
    differences = [abs(gpu_run.losses[s] - cpu_run.losses[s]) / cpu_run.losses[s] for s in steps]
    print(f"{precision} on CUDA vs fp32 on the CPU, relative loss difference per step: {differences}")
    assert max(differences) < LOSS_MATCH[precision], differences


# --- 4. speculative decoding on CUDA ---------------------------------------------------------------------


@pytest.fixture(scope="module", params=FAMILIES)
def cuda_pair(request, target_dirs, make_drafter):
    """(target, drafter) on the GPU: the conftest tiny target of a family and a random EAGLE-3 drafter."""
    target = FrozenTarget.load(TargetConfig(name_or_path=str(target_dirs[request.param]), layer_ids=LAYER_IDS))
    drafter = make_drafter(target)
    return target.to(CUDA), drafter.to(CUDA).eval()


@pytest.mark.parametrize("k", [3, 5])
def test_greedy_speculation_on_cuda_is_target_only_decoding(cuda_pair, text_batch, k):
    target, drafter = cuda_pair
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0)
        seq = prompt + generate(target, None, prompt, MAX_NEW + k + 2, k=0).tokens
        for proposer in (drafter, OracleDrafter(target, seq, wrong_positions)):
            spec = generate(target, proposer, prompt, MAX_NEW, k=k)
            assert spec.tokens == base.tokens, type(proposer).__name__
            check_stats(spec.stats, k, len(spec.tokens))


def test_batched_greedy_speculation_on_cuda_is_target_only_decoding(cuda_pair, text_batch):
    target, drafter = cuda_pair
    prompts = prompts_of(text_batch)
    base = generate_batch(target, None, prompts, MAX_NEW, k=0)
    spec = generate_batch(target, drafter, prompts, MAX_NEW, k=3)
    assert spec.tokens == base.tokens and all(len(tokens) == MAX_NEW for tokens in base.tokens)


@pytest.mark.parametrize("plan", [False, True])
@pytest.mark.parametrize("family", ["dspark", "dflash"])
def test_block_drafters_on_cuda_are_target_only_decoding(family, plan, llama_dir, text_batch, tmp_path):
    """DSpark's Markov slots decoded one by one and its confidence planned against step costs timed on the GPU
    (synchronized), DFlash's one pass: greedy output token for token target-only decoding; sampling runs."""
    target = FrozenTarget.load(TargetConfig(name_or_path=str(llama_dir), layer_ids=LAYER_IDS))
    make = make_dspark if family == "dspark" else make_dflash
    drafter = make(target, text_batch, num_layers=2).to(CUDA).eval()
    target = target.to(CUDA)
    drafting = DraftingConfig(plan=plan, cost_table=str(tmp_path / "costs.json"))
    for prompt in prompts_of(text_batch):
        base = generate(target, None, prompt, MAX_NEW, k=0)
        spec = generate(target, drafter, prompt, MAX_NEW, k=4, drafting=drafting)
        assert spec.tokens == base.tokens and spec.stats.num_drafts > 0
        sampled = generate(target, drafter, prompt, MAX_NEW, k=4, temperature=1.0, seed=3, drafting=drafting)
        assert all(0 <= t < target.vocab_size for t in sampled.tokens)


# --- 5. train.py on one GPU ------------------------------------------------------------------------------


def test_train_py_with_trainer_gpu_trains_exports_and_reports(llama_dir, tmp_path):
    run_dir = tmp_path / "run"
    result = run_train([
        "conf=eagle3_pycode", "trainer=gpu", "trainer.devices=1", "trainer.max_steps=3", "logger=none",
        f"hydra.run.dir={run_dir}", f"target.name_or_path={llama_dir}",
        "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", f"drafter.draft_vocab_size={VOCAB_SIZE // 2}",
        "drafter.depth=2", "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "trainer.progress_bar=false",
        "eval.num_prompts=2", "serve_eval.ks=[1,2]",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "export" / "model.safetensors").is_file()
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["outputs_match_baseline"] and report["acceptance_length"] >= 1


def test_train_py_from_the_hidden_state_cache_serves_its_report_on_the_gpu(llama_dir, data_file, tmp_path):  # noqa: F811
    """With data.hidden_states=cache the closing report loads the whole target after training, when Lightning has
    moved the module back to the CPU: it must serve on the GPU the run trained on."""
    common = ["conf=eagle3_pycode", "trainer=gpu", "trainer.devices=1", "logger=none", f"target.name_or_path={llama_dir}",
              "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", "data=text", f"data.path={data_file}",
              "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2", "data.hidden_states=cache", f"data.cache_dir={tmp_path / 'cache'}"]
    built = subprocess.run([sys.executable, "-m", "train.hidden_cache", *common, f"hydra.run.dir={tmp_path / 'b'}"],
                           cwd=REPO, capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr[-3000:]
    run_dir = tmp_path / "run"
    result = run_train(common + [
        "trainer.max_steps=3", f"drafter.draft_vocab_size={VOCAB_SIZE // 2}", "drafter.depth=2",
        "trainer.val_every_n_steps=3", "trainer.checkpoint_every_n_steps=3", "trainer.progress_bar=false",
        "serve_eval.every_n_steps=0", "eval.num_prompts=2", "serve_eval.ks=[1]", f"hydra.run.dir={run_dir}",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["device"].startswith("cuda") and report["outputs_match_baseline"]


def test_train_py_trains_dspark_on_the_gpu_and_plans_its_report(llama_dir, tmp_path):
    """conf=dspark_pycode on CUDA: the heads train, the closing report calibrates, times the step costs on the GPU and
    serves the plan there, and writes sts.json / sps.json beside the export."""
    run_dir = tmp_path / "run"
    result = run_train([
        "conf=dspark_pycode", "trainer=gpu", "trainer.devices=1", "trainer.max_steps=3", "logger=none",
        f"hydra.run.dir={run_dir}", f"target.name_or_path={llama_dir}",
        "target.layer_ids=[" + ",".join(map(str, LAYER_IDS)) + "]", "drafter.num_layers=2",
        f"drafter.draft_vocab_size={VOCAB_SIZE // 2}", "drafter.block_size=4", "drafter.markov_rank=8",
        "data.seq_len=64", "data.batch_size=2", "data.max_val_sequences=2", "trainer.val_every_n_steps=3",
        "trainer.checkpoint_every_n_steps=3", "trainer.progress_bar=false", "eval.num_prompts=2", "serve_eval.ks=[1,3]",
    ], cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "acceptance" / "report.json").read_text())
    assert report["device"].startswith("cuda") and report["outputs_match_baseline"]
    assert (run_dir / "export" / "sts.json").is_file() and (run_dir / "export" / "sps.json").is_file()
