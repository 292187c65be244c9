"""framework/tasks/online_rl/generator.py: the same completions as ``sampling.generate`` (``model.generate`` with
keyed sampling) for the same seeds, on a tiny Llama, a tiny GPT-2 and a LoRA-adapted Llama, with top-k and top-p;
each drawn token's recorded log-probability equal to a plain forward's over the whole sequence within 1e-5
(SmolLM2 with LoRA, slow: the same completions, and log-probabilities as close as the forward is to itself, 2e-5);
stopped rows leave the batch; stop sequences; compiled decoding, one graph per cache shape, none again on later
calls."""

from __future__ import annotations

import json
from typing import List

import pytest
import torch
from torch._dynamo.utils import counters

from framework.tasks.online_rl import sampling
from framework.tasks.online_rl.generator import Generator, bucket
from framework.tasks.online_rl.sampling import Sampling, row_seed
from helpers import ROOT

VOCAB, EOS, PAD = 40, 0, 1
STOPS = [EOS, 2, 3]  # several stop tokens: rows of a near-uniform tiny model stop early too
# Prompts of uneven lengths (left padding differs per row), two of them repeated (the prefill runs each distinct
# prompt once), drawn from a fixed generator.
_draw = torch.Generator().manual_seed(1)
PROMPTS = [torch.randint(3, VOCAB, (n,), generator=_draw).tolist() for n in (3, 9, 5, 12, 1, 7)]
PROMPTS += [PROMPTS[1], PROMPTS[0]]
SEEDS = [row_seed(42, 0, i // 2, i % 2) for i in range(len(PROMPTS))]


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False, eos_token_id=EOS, pad_token_id=PAD)).eval()


def tiny_gpt2() -> torch.nn.Module:
    """tests/tiny_lm.yaml's GPT-2: 64 positions, fewer than the cache's slots (80): positions count real tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=EOS,
                                      eos_token_id=EOS)).eval()


def lora_llama() -> torch.nn.Module:
    """The tiny Llama with LoRA on every linear layer, its B matrices random (peft starts them at 0)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.1)
    return model.eval()


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "llama+lora": lora_llama}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def settings(temperature=1.0, top_k=0, top_p=1.0, new=16) -> Sampling:
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=new, stop_ids=STOPS,
                    pad_id=PAD)


def test_bucket():
    assert [bucket(n) for n in (1, 47, 64, 65, 128, 129, 300)] == [64, 64, 64, 128, 128, 256, 512]


@pytest.mark.parametrize("top_k,top_p,greedy", [(0, 1.0, False), (5, 1.0, False), (0, 0.9, False),
                                                (0, 1.0, True)])
def test_same_completions_as_sampling_generate(model, top_k, top_p, greedy):
    """Row for row, the completions ``model.generate`` with keyed sampling draws (temperature 1; greedy: the
    argmax), some stopped at the stop token and some at 16 tokens; ``synced`` on one process changes nothing."""
    s = settings(top_k=top_k, top_p=top_p)
    expected = sampling.generate(model, PROMPTS, SEEDS, s, greedy=greedy)
    got = Generator()(model, PROMPTS, SEEDS, s, greedy=greedy).completions
    mismatches = sum(a != b for a, b in zip(expected, got))
    assert mismatches == 0, (expected, got)
    assert Generator()(model, PROMPTS, SEEDS, s, greedy=greedy, synced=True).completions == expected
    if not greedy:
        assert {len(c) for c in expected} >= {16} and any(c[-1] in STOPS for c in expected)


def test_a_row_draws_the_same_alone_or_in_a_batch(model):
    """Keyed by its seed: a row's completion alone is the one it draws third in the batch."""
    s = settings(top_k=5)
    alone = Generator()(model, [PROMPTS[2]], [SEEDS[2]], s).completions[0]
    assert Generator()(model, PROMPTS, SEEDS, s).completions[2] == alone


def right_padded_logprobs(model, prompts: List[List[int]], completions: List[List[int]], temperature: float,
                          pad_id: int = PAD):
    """Each completion token's log-probability under log_softmax(logits / temperature) of one plain forward of
    prompt + completion, right-padded (positions 0..n-1), as the GRPO training forward sees them."""
    longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), longest), pad_id)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention_mask[i, :len(p) + len(c)] = 1
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=input_ids, attention_mask=attention_mask).logits / temperature, -1)
    return [logp[i, len(p) - 1:len(p) + len(c) - 1].gather(1, torch.tensor(c)[:, None])[:, 0].tolist()
            for i, (p, c) in enumerate(zip(prompts, completions))]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_recorded_logprobs_equal_the_training_forwards(model, temperature, top_k):
    """The log-probability recorded at each draw (of the logits over the temperature, whatever top-k removed)
    equals a plain forward's of the whole right-padded sequence within 1e-5."""
    out = Generator()(model, PROMPTS, SEEDS, settings(temperature=temperature, top_k=top_k), logprobs=True)
    expected = right_padded_logprobs(model, PROMPTS, out.completions, temperature)
    assert [len(r) for r in out.logprobs] == [len(c) for c in out.completions]
    worst = max(abs(a - b) for got, want in zip(out.logprobs, expected) for a, b in zip(got, want))
    print(f"max |recorded - forward| {worst:.1e}")
    assert worst <= 1e-5


def test_stop_sequences():
    """A completion that ends with a stop sequence ends there (the sequence kept); the others are unchanged."""
    model, s = tiny_llama(), settings()
    free = Generator()(model, PROMPTS, SEEDS, s).completions
    row = max(range(len(free)), key=lambda i: len(free[i]))
    sequence = free[row][3:5]  # two tokens the longest completion draws
    end = next(i + 2 for i in range(len(free[row]) - 1) if free[row][i:i + 2] == sequence)
    stopped = Generator()(model, PROMPTS, SEEDS, s, stop_sequences=[sequence, [VOCAB - 1] * 20]).completions
    for got, unstopped in zip(stopped, free):
        ends = [i + 2 for i in range(len(unstopped) - 1) if unstopped[i:i + 2] == sequence]
        assert got == (unstopped[:ends[0]] if ends else unstopped)
    assert stopped[row] == free[row][:end] and end <= 5


def test_stopped_rows_leave_the_batch():
    """Eager, each decode step runs the rows still running only; the prefill, each distinct prompt once."""
    model, s = tiny_llama(), settings()
    batch_rows = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: batch_rows.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    generated = Generator()
    completions = generated(model, PROMPTS, SEEDS, s).completions
    hook.remove()
    running = [sum(len(c) > step for c in completions) for step in range(1, max(map(len, completions)))]
    assert batch_rows == [len(set(map(tuple, PROMPTS)))] + running and running[0] > running[-1]
    assert generated.timings.steps == len(running) == 15


def test_compiled_decode_keeps_one_graph_per_cache_shape():
    """Compiled decoding (dynamo's capture and guards; the eager backend skips inductor's code generation, which
    the slow test below runs) masks the stopped rows: the same completions, and one graph for three calls of a
    bucket whose prompts and stops differ; a prompt over 64 tokens makes the one other shape."""
    torch._dynamo.reset()
    counters.clear()
    model, s = tiny_llama(), settings()
    compiled, eager = Generator(compile="eager"), Generator()
    for prompts in (PROMPTS, PROMPTS[::-1], [p + [7] * 5 for p in PROMPTS]):
        assert compiled(model, prompts, SEEDS, s).completions == eager(model, prompts, SEEDS, s).completions
    assert counters["stats"]["unique_graphs"] == 1
    long = [PROMPTS[0] * 30] + PROMPTS[1:]
    assert compiled(model, long, SEEDS, s).completions == eager(model, long, SEEDS, s).completions
    assert counters["stats"]["unique_graphs"] == 2


@pytest.mark.parametrize("top_k,greedy", [(0, False), (5, False), (0, True)])
def test_fixed_shapes_draw_the_same(model, top_k, greedy):
    """``static`` (XLA's fixed shapes, here on the CPU): prompts in fixed slots, the distinct prompts padded to a
    power of two, stopped rows masked and every row stepped until all have stopped (read every 4 steps): the same
    completions and recorded log-probabilities (within 1e-6) as the eager generator, and stop sequences cut alike."""
    s = settings(temperature=0.7, top_k=top_k)
    eager = Generator()(model, PROMPTS, SEEDS, s, greedy=greedy, logprobs=True)
    static = Generator(static=True, prompt_slots=16)
    out = static(model, PROMPTS, SEEDS, s, greedy=greedy, logprobs=True)
    assert out.completions == eager.completions
    assert max(abs(a - b) for x, y in zip(out.logprobs, eager.logprobs) for a, b in zip(x, y)) <= 1e-6
    assert static.timings.steps == max(map(len, eager.completions)) == 16  # a row ran to the longest completion
    sequence = max(eager.completions, key=len)[2:4]
    assert (static(model, PROMPTS, SEEDS, s, greedy=greedy, stop_sequences=[sequence]).completions
            == Generator()(model, PROMPTS, SEEDS, s, greedy=greedy, stop_sequences=[sequence]).completions)


@pytest.mark.slow
def test_inductor_compiled_decode_draws_the_same():
    """Inductor's compiled decode step (a minute to compile on 2 cores): the eager step's completions, log-
    probabilities within 1e-5, and no recompilation on the next calls."""
    torch._dynamo.reset()
    counters.clear()
    model, s = tiny_llama(), settings(top_k=5)
    compiled = Generator(compile="inductor")
    expected = Generator()(model, PROMPTS, SEEDS, s, logprobs=True)
    for _ in range(3):
        out = compiled(model, PROMPTS, SEEDS, s, logprobs=True)
        assert out.completions == expected.completions
        assert max(abs(a - b) for x, y in zip(out.logprobs, expected.logprobs) for a, b in zip(x, y)) <= 1e-5
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
@pytest.mark.llm
def test_smollm2_with_lora_draws_the_same_and_records_the_training_forwards_logprobs():
    """SmolLM2-135M-Instruct with LoRA (B random), 4 chat prompts x 2 of uneven lengths, up to 24 tokens: the
    completions ``sampling.generate`` draws with top-k and top-p; the recorded log-probabilities differ from the
    batched forward's by no more than that forward differs from itself run a row at a time (fp32 over 30 layers:
    about 2e-5 on log-probabilities of -2 to -10), so 5e-5."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ROOT / "assets" / "SmolLM2-135M-Instruct"
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.01)
    rows = [json.loads(line) for line in (ROOT / "assets" / "sums.jsonl").read_text().splitlines()[:4]]
    prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))
               ["input_ids"] for r in rows for _ in range(2)]
    prompts[1], prompts[5] = prompts[1][:30], prompts[5][:40]
    seeds = [row_seed(42, 0, i, 0) for i in range(len(prompts))]
    s = Sampling(temperature=0.7, top_k=20, top_p=0.95, max_new_tokens=24,
                 stop_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")], pad_id=tokenizer.pad_token_id)
    out = Generator()(model, prompts, seeds, s, logprobs=True)
    assert out.completions == sampling.generate(model, prompts, seeds, s)
    batched = right_padded_logprobs(model, prompts, out.completions, s.temperature, s.pad_id)
    alone = [right_padded_logprobs(model, [p], [c], s.temperature, s.pad_id)[0]
             for p, c in zip(prompts, out.completions)]
    worst = max(abs(a - b) for x, y in zip(out.logprobs, batched) for a, b in zip(x, y))
    floor = max(abs(a - b) for x, y in zip(alone, batched) for a, b in zip(x, y))
    print(f"max |recorded - batched forward| {worst:.1e}; |row-at-a-time - batched forward| {floor:.1e}")
    assert worst <= 5e-5 and floor <= 5e-5
