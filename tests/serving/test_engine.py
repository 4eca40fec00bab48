"""The batching engine in process, stepped by hand: sequences that join and leave a running batch get exactly the
values they get alone, echoed prompts are scored as a forward pass scores them, and cancelled or finished rows free
their slots."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Qwen3NextConfig

from ats.errors import ATSError
from ats.generation import SamplingParams, TextTracker, generate_calibrated, tokens_covering
from ats.generation.batch import check_attention
from ats.generation.limits import ContextLengthExceeded
from ats.model.backbone import Backbone
from ats.serving.engine import Engine, Job, JobDone, JobFailed, QueueFull, ShuttingDown

from helpers import calibrator_for
from serving_reference import chat_ids, choices, continuation_values, done, forward, prompt_scores

PROMPTS = ["The capital of France is", "Write a short poem about the sea and the wind, please.", "Hi"]
GREEDY = SamplingParams(temperature=0)


def job(ids, events, **options) -> Job:
    return Job([ids] if isinstance(ids[0], int) else ids, sink=events.append, **options)


def run(engine: Engine) -> int:
    steps = 0
    while engine.step():
        steps += 1
    return steps


def close(actual, expected) -> None:
    """Log-probabilities equal to 1e-4 (batched and single forward passes differ by float32 rounding, which the tiny
    model's large logits amplify: by up to 2.1e-5 seen on Intel and AMD machines of this kind)."""
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), expected, atol=1e-4, rtol=1e-5)


def assert_matches(backbone, calibrator, prompt_ids, choice):
    """The choice's per-token values equal one full forward pass over prompt + its tokens."""
    tokens = [t.token for t in choice["tokens"]]
    logq, logz, tau = continuation_values(backbone, calibrator, prompt_ids, tokens)
    close([t.logprob for t in choice["tokens"]], logq)
    close([t.uncalibrated for t in choice["tokens"]], logz)
    close([t.tau for t in choice["tokens"]], tau)


def test_sequences_joining_a_running_batch_get_their_values_alone(backbone, calibrator):
    refs = generate_calibrated(backbone, calibrator, PROMPTS, max_new_tokens=12)  # batched, left-padded: as alone
    alone = [generate_calibrated(backbone, calibrator, p, max_new_tokens=12)[0] for p in PROMPTS]
    assert [r.token_ids for r in refs] == [a.token_ids for a in alone]
    engine = Engine(backbone, calibrator, max_batch=4)
    events = [[], [], []]
    jobs = [job(chat_ids(backbone, p), events[i], max_tokens=m, sampling=GREEDY, top_logprobs=3)
            for i, (p, m) in enumerate(zip(PROMPTS, (12, 5, 12)))]
    engine.submit(jobs[0])
    for _ in range(3):
        engine.step()
    engine.submit(jobs[1])  # a longer prompt joins: the running row is left-padded
    engine.step()
    assert engine.stats()["running"] == 2
    engine.submit(jobs[2])  # a shorter one joins
    engine.step()
    assert engine.stats()["running"] == 3
    run(engine)
    assert engine.stats()["running"] == 0 and all(done(e) for e in events)
    for i, (ref, max_tokens) in enumerate(zip(alone, (12, 5, 12))):
        choice = choices(events[i])[0]
        assert [t.token for t in choice["tokens"]] == ref.token_ids[:max_tokens]
        assert choice["finish"] == "length"
        if max_tokens == 12:
            assert choice["text"] == ref.text
            # batch composition changes float32 rounding (by 1.9e-5 seen on an AMD EPYC): equal to 1e-4
            torch.testing.assert_close(torch.tensor([t.logprob for t in choice["tokens"]]).exp(),
                                       torch.tensor(ref.confidences), atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor([t.tau for t in choice["tokens"]]), torch.tensor(ref.taus),
                                       atol=1e-4, rtol=0)
        assert_matches(backbone, calibrator, chat_ids(backbone, PROMPTS[i]), choice)
        # the top alternatives are the calibrated distribution's, best first, the greedy token among them first
        logq, _, _ = forward(backbone, calibrator, chat_ids(backbone, PROMPTS[i]) + ref.token_ids[:max_tokens])
        first = choice["tokens"][0]
        P = len(chat_ids(backbone, PROMPTS[i]))
        best = logq[P - 1].topk(3)
        assert [i for i, _ in first.top] == best.indices.tolist() and first.top[0][0] == first.token
        close([lp for _, lp in first.top], best.values)


def test_head_tau_moves_the_probabilities(backbone, calibrator):
    events = []
    engine = Engine(backbone, calibrator)
    engine.submit(job(chat_ids(backbone, PROMPTS[0]), events, max_tokens=6, sampling=GREEDY))
    run(engine)
    tokens = choices(events)[0]["tokens"]
    assert max(abs(t.tau) for t in tokens) > 0.05
    assert max(abs(t.logprob - t.uncalibrated) for t in tokens) > 1e-3


def test_replicas_share_the_prompt_and_sample_reproducibly(backbone, calibrator):
    ids = chat_ids(backbone, PROMPTS[1])

    def sample(seed):
        events = []
        engine = Engine(backbone, calibrator, max_batch=8)
        engine.submit(job(ids, events, n=3, max_tokens=8, sampling=SamplingParams(temperature=1.0, seed=seed)))
        run(engine)
        return choices(events)

    a, b, c = sample(5), sample(5), sample(6)
    tokens = {k: [t.token for t in v["tokens"]] for k, v in a.items()}
    assert sorted(tokens) == [0, 1, 2]
    assert tokens == {k: [t.token for t in v["tokens"]] for k, v in b.items()}
    assert len({tuple(t) for t in tokens.values()}) > 1  # three draws, not one repeated
    assert tokens != {k: [t.token for t in v["tokens"]] for k, v in c.items()}
    for choice in a.values():
        assert_matches(backbone, calibrator, ids, choice)


def test_top_p_near_zero_is_greedy_and_filter_keeps_the_nucleus(backbone, calibrator):
    ids = chat_ids(backbone, PROMPTS[0])
    greedy, nucleus = [], []
    engine = Engine(backbone, calibrator)
    engine.submit(job(ids, greedy, max_tokens=6, sampling=GREEDY))
    engine.submit(job(ids, nucleus, max_tokens=6, sampling=SamplingParams(temperature=1.0, top_p=1e-6, seed=1)))
    run(engine)
    assert [t.token for t in choices(greedy)[0]["tokens"]] == [t.token for t in choices(nucleus)[0]["tokens"]]
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = SamplingParams(top_p=0.7).warp(probs.log()).softmax(-1)  # transformers' TopPLogitsWarper: 0.5 + 0.3
    torch.testing.assert_close(kept, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_echoed_prompts_are_scored_like_a_forward_pass(backbone, calibrator):
    texts = ["The quick brown fox jumps over the lazy dog", "One two"]
    prompts = [backbone.tokenizer(t)["input_ids"] for t in texts]
    events = []
    engine = Engine(backbone, calibrator)
    engine.submit(job(prompts, events, max_tokens=0, prompt_logprobs=True, top_logprobs=2))
    run(engine)
    scored = prompt_scores(events)
    assert sorted(scored) == [0, 1] and done(events)
    for p, ids in enumerate(prompts):
        logq, logz, tau = forward(backbone, calibrator, ids)
        rows, target = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
        tokens = scored[p]
        assert [t.token for t in tokens] == ids and tokens[0].logprob is None
        close([t.logprob for t in tokens[1:]], logq[rows, target])
        close([t.uncalibrated for t in tokens[1:]], logz[rows, target])
        close([t.tau for t in tokens[1:]], tau[:-1])
        assert [[i for i, _ in t.top] for t in tokens[1:]] == logq[:-1].topk(2).indices.tolist()
    assert {c: (v["tokens"], v["finish"]) for c, v in choices(events).items()} == {0: ([], "length"),
                                                                                   1: ([], "length")}


@pytest.mark.parametrize("head_type", ["linear", None])
def test_per_token_head_and_uncalibrated_engine(backbone, head_type):
    calibrator = calibrator_for(backbone, head_type, seed=2) if head_type else None
    ids = chat_ids(backbone, PROMPTS[1])
    events, others = [], []
    engine = Engine(backbone, calibrator, max_batch=2)
    engine.submit(job(chat_ids(backbone, PROMPTS[2]), others, max_tokens=3, sampling=GREEDY))
    engine.step()
    engine.submit(job(ids, events, max_tokens=8, sampling=SamplingParams(temperature=0.8, seed=3)))
    run(engine)
    choice = choices(events)[0]
    assert len(choice["tokens"]) == 8
    assert_matches(backbone, calibrator, ids, choice)
    if calibrator is None:
        assert all(t.tau == 0 and t.logprob == t.uncalibrated for t in choice["tokens"])


def test_cancelled_job_frees_its_rows_and_stops_its_events(backbone, calibrator):
    events, other = [], []
    engine = Engine(backbone, calibrator)
    long = job(chat_ids(backbone, PROMPTS[0]), events, max_tokens=200, sampling=GREEDY)
    engine.submit(long)
    engine.submit(job(chat_ids(backbone, PROMPTS[1]), other, max_tokens=8, sampling=GREEDY))
    engine.step()
    engine.step()
    engine.cancel(long)
    seen = len(events)
    engine.step()
    assert engine.stats()["running"] == 1 and engine.stats()["cancelled"] == 1
    run(engine)
    assert len(events) == seen and not done(events)
    assert done(other) and len(choices(other)[0]["tokens"]) == 8


def test_models_with_linear_attention_layers_are_refused():
    assert check_attention(Gemma3TextConfig(num_hidden_layers=12)) == 12  # sliding-window layers run
    with pytest.raises(ATSError, match="full or sliding-window attention; this one has linear_attention layers"):
        check_attention(Qwen3NextConfig())


@pytest.fixture(scope="module")
def gemma(tokenizer) -> Backbone:
    """A random Gemma 3 whose first two layers attend to a window of 4 tokens, far shorter than the prompts."""
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=4, max_position_embeddings=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)  # varied greedy text, top-1 probabilities well below 1
    return Backbone(model=model, tokenizer=tokenizer, name="tiny-gemma3", revision="seed0")


def test_sliding_window_rows_joining_a_batch_get_a_full_pass_values(gemma):
    """Rows of a sliding-window model that join and leave a running batch (left-padded, trimmed) get the values of
    one unpadded forward pass, where transformers applies the window itself, and greedy text equals its generate."""
    calibrator = calibrator_for(gemma, seed=1)
    engine = Engine(gemma, calibrator, max_batch=4)
    events = [[], [], []]
    for i, (p, m) in enumerate(zip(PROMPTS, (12, 5, 12))):
        engine.submit(job(chat_ids(gemma, p), events[i], max_tokens=m, sampling=GREEDY))
        for _ in range(3):
            engine.step()
    run(engine)
    assert all(done(e) for e in events)
    for i, p in enumerate(PROMPTS):
        choice, ids = choices(events[i])[0], chat_ids(gemma, p)
        assert len(ids) > 4 * 4  # the window matters
        assert_matches(gemma, calibrator, ids, choice)
        plain = gemma.model.generate(torch.tensor([ids]), max_new_tokens=len(choice["tokens"]), do_sample=False,
                                     pad_token_id=gemma.tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert [t.token for t in choice["tokens"]] == plain


def test_queue_is_bounded_and_requests_are_checked(backbone, calibrator):
    engine = Engine(backbone, calibrator, max_queue=1, max_model_len=64)
    ids = chat_ids(backbone, PROMPTS[0])
    engine.submit(Job([ids], max_tokens=4))
    with pytest.raises(QueueFull):
        engine.submit(Job([ids], max_tokens=4))
    with pytest.raises(ContextLengthExceeded, match="maximum context length is 64 tokens"):
        engine.check(Job([ids], max_tokens=64))
    with pytest.raises(ATSError, match="outside the vocabulary"):
        engine.check(Job([[1, backbone.vocab_size]], max_tokens=1))
    with pytest.raises(ATSError, match="empty"):
        engine.check(Job([[]], max_tokens=1))
    limit = backbone.model.config.max_position_embeddings
    assert Engine(backbone, calibrator, max_model_len=limit).max_model_len == limit
    with pytest.raises(ATSError, match=rf"max_model_len {limit + 1} is more than .*'s context of {limit} tokens"):
        Engine(backbone, calibrator, max_model_len=limit + 1)  # was cut to the model's without a word


def test_stop_string_cuts_text_and_tokens_as_generate_does(backbone, calibrator):
    ids = chat_ids(backbone, PROMPTS[1])

    def generate(stop=()):
        events = []
        engine = Engine(backbone, calibrator)
        engine.submit(job(ids, events, max_tokens=20, sampling=SamplingParams(temperature=1.5, seed=11), stop=stop))
        run(engine)
        return choices(events)[0]

    full = generate()
    text = full["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = text.find(stop)
    out = generate([stop])
    assert out["finish"] == "stop" and out["text"] == text[:cut]
    full_ids = [t.token for t in full["tokens"]]
    kept = tokens_covering(backbone.tokenizer, full_ids, cut)
    assert [t.token for t in out["tokens"]] == full_ids[:kept]
    assert all(stop not in piece for piece in out["pieces"])


def test_text_tracker_holds_back_possible_stops_and_partial_characters(tokenizer):
    text = "Hello world, this is a test. Ünïcödé 🙂 done"
    ids = tokenizer(text)["input_ids"]
    tracker = TextTracker(tokenizer, ["is a"])
    pieces = []
    for token in ids:
        stopped = tracker.add(token)
        pieces.append(tracker.release(final=stopped)[0])
        if stopped:
            break
    assert "".join(pieces) == "Hello world, this " and tracker.text == "Hello world, this "
    assert tracker.sent_tokens == len(tracker.ids) == tokens_covering(tokenizer, ids, len("Hello world, this "))
    plain = TextTracker(tokenizer)
    pieces = [plain.add(t) or plain.release()[0] for t in ids]
    pieces.append(plain.release(final=True)[0])
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert plain.offsets == [len(tokenizer.decode(ids[:i], skip_special_tokens=True)) for i in range(len(ids))]


def test_rows_that_finish_at_prefill_get_one_token_and_the_job_ends_once(backbone, calibrator):
    """max_tokens=1: each row's only token comes from its prefill; a decoding step must not feed it again (it gave
    a second token and counted the row's end twice, so the job was 'done' while half its rows still ran)."""
    prompts = [chat_ids(backbone, p) for p in PROMPTS] * 3  # 9 rows through a batch of 4
    events: list = []
    engine = Engine(backbone, calibrator, max_batch=4)
    engine.submit(job(prompts, events, max_tokens=1, sampling=GREEDY))
    steps = run(engine)
    assert done(events) and sum(isinstance(e, JobDone) for e in events) == 1
    got = choices(events)
    assert sorted(got) == list(range(9))
    assert all(len(c["tokens"]) == 1 and c["finish"] == "length" for c in got.values())
    assert [got[i]["tokens"][0].token for i in range(3)] == [got[i + 3]["tokens"][0].token for i in range(3)]
    assert steps == 3  # one prefill per batch of 4, 4 and 1 rows, and no decoding step


class _NoGenerator(SamplingParams):
    def generator(self):
        raise RuntimeError("this job cannot start")


def test_a_job_whose_admission_fails_is_failed_not_left_waiting(backbone, calibrator):
    """A job the engine cannot start (its random generator fails: once a seed torch refused, which left the client
    waiting forever) ends with a failure event naming why; the job behind it still runs."""
    bad, good = [], []
    engine = Engine(backbone, calibrator)
    engine.submit(job(chat_ids(backbone, PROMPTS[2]), bad, max_tokens=2, sampling=_NoGenerator(temperature=1)))
    engine.submit(job(chat_ids(backbone, PROMPTS[2]), good, max_tokens=2, sampling=GREEDY))
    run(engine)
    assert len(bad) == 1 and isinstance(bad[0], JobFailed) and "this job cannot start" in bad[0].message
    assert done(good) and len(choices(good)[0]["tokens"]) == 2


@pytest.mark.parametrize("seed", [-2 ** 63, 0, 2 ** 64 - 1])
def test_every_seed_torch_takes_is_accepted_and_reproducible(seed):
    draws = [torch.rand(3, generator=SamplingParams(seed=seed).generator()) for _ in range(2)]
    torch.testing.assert_close(draws[0], draws[1], rtol=0, atol=0)


@pytest.mark.parametrize("seed", [-2 ** 63 - 1, 2 ** 64, 2 ** 70])
def test_a_seed_torch_refuses_is_refused_naming_the_range(seed):
    with pytest.raises(ValueError, match=rf"seed must be an integer in \[-9223372036854775808, "
                                         rf"18446744073709551615\], got {seed}"):
        SamplingParams(seed=seed)


def test_random_mixes_of_jobs_each_end_once_with_what_they_get_alone(backbone, calibrator):
    """Jobs of 1-4 prompts x n 1-3, max_tokens 0-5, stop strings and echo, through a batch of 3 rows: every job
    ends exactly once, last, with all its choices, each as long as asked and with the tokens and values it gets
    run alone (a row that ends at prefill, or while others of its job wait, is the case a bookkeeping slip breaks)."""
    import random

    rng = random.Random(0)
    pool = [chat_ids(backbone, p) for p in PROMPTS] + [[5, 6, 7], [42]]
    specs = [dict(prompts=rng.sample(pool, rng.randint(1, 4)), n=rng.randint(1, 3), max_tokens=rng.randint(0, 5),
                  stop=rng.choice([(), ("w",), (" w1",)]), prompt_logprobs=rng.random() < 0.3) for _ in range(12)]

    def run_jobs(batch_specs, max_batch):
        engine = Engine(backbone, calibrator, max_batch=max_batch)
        sinks = [[] for _ in batch_specs]
        for spec, sink in zip(batch_specs, sinks):
            engine.submit(Job(spec["prompts"], n=spec["n"], max_tokens=spec["max_tokens"], sampling=GREEDY,
                              stop=spec["stop"], prompt_logprobs=spec["prompt_logprobs"], sink=sink.append))
        run(engine)
        return sinks

    mixed = run_jobs(specs, max_batch=3)
    for spec, events in zip(specs, mixed):
        (alone,) = run_jobs([spec], max_batch=16)
        assert done(events) and sum(isinstance(e, (JobDone, JobFailed)) for e in events) == 1
        got, want = choices(events), choices(alone)
        assert sorted(got) == list(range(len(spec["prompts"]) * spec["n"]))
        for k, choice in got.items():
            assert len(choice["tokens"]) <= spec["max_tokens"] and choice["finish"] in ("length", "stop", "eos")
            assert choice["text"] == want[k]["text"]
            assert [t.token for t in choice["tokens"]] == [t.token for t in want[k]["tokens"]]
            close([t.logprob for t in choice["tokens"]], torch.tensor([t.logprob for t in want[k]["tokens"]]))
        if spec["prompt_logprobs"]:
            assert sorted(prompt_scores(events)) == list(range(len(spec["prompts"])))


def test_min_tokens_holds_back_the_end_of_sequence(tokenizer):
    """A model whose end-of-sequence token is made the greedy first choice (its output row 1.5 times the first
    token's): it ends at once, unless min_tokens forbids that; then the first token is the one it outranked."""
    from ats.generation import eos_ids

    from helpers import make_tiny_backbone

    bb = make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0)
    ids = chat_ids(bb, PROMPTS[2])

    def answer(**options):
        events = []
        engine = Engine(bb, None)
        engine.submit(job(ids, events, sampling=GREEDY, **options))
        run(engine)
        return choices(events)[0]

    first = answer(max_tokens=1)["tokens"][0].token
    eos = min(eos_ids(bb))
    with torch.no_grad():
        hidden, _ = bb.forward(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
        assert first != eos and bb.logits(hidden[:, -1])[0, first] > 0  # so 1.5 times its row outranks it
        weight = bb.model.get_output_embeddings().weight
        weight[eos] = 1.5 * weight[first]
    ended = answer(max_tokens=6)
    assert [t.token for t in ended["tokens"]] == [eos] and ended["finish"] == "stop"  # OpenAI's name for it
    held = answer(max_tokens=6, min_tokens=3)
    tokens = [t.token for t in held["tokens"]]
    assert tokens[0] == first and eos not in tokens[:3] and len(tokens) >= 3


class _Events(list):
    """A job's sink on the engine thread: the events, and a flag set at the first and at the last."""

    def __init__(self) -> None:
        super().__init__()
        self.started, self.ended = threading.Event(), threading.Event()

    def append(self, event) -> None:
        super().append(event)
        self.started.set()
        if isinstance(event, (JobDone, JobFailed)):
            self.ended.set()


def test_drain_lets_jobs_finish_within_the_grace_period_and_takes_no_new_one(backbone, calibrator):
    engine = Engine(backbone, calibrator, max_batch=2)
    engine.start()
    try:
        events = _Events()
        engine.submit(job(chat_ids(backbone, PROMPTS[0]), events, n=3, max_tokens=40, sampling=GREEDY,
                          ignore_eos=True))  # 3 rows through a batch of 2: one still waits for a row
        assert events.started.wait(60)
        engine.drain(120)
        assert engine.draining
        with pytest.raises(ShuttingDown):
            engine.submit(Job([chat_ids(backbone, PROMPTS[1])], max_tokens=2))
        assert events.ended.wait(120)
    finally:
        engine.stop()
    assert done(events) and not any(isinstance(e, JobFailed) for e in events)
    assert [len(c["tokens"]) for c in choices(events).values()] == [40, 40, 40]


def test_drain_fails_what_is_still_running_at_its_deadline_with_a_503(backbone, calibrator):
    engine = Engine(backbone, calibrator, max_batch=1)
    engine.start()
    try:
        running, waiting = _Events(), _Events()
        limit = engine.max_model_len
        ids = chat_ids(backbone, PROMPTS[0])
        engine.submit(job(ids, running, max_tokens=limit - len(ids), sampling=GREEDY, ignore_eos=True))
        engine.submit(job(ids, waiting, max_tokens=4, sampling=GREEDY))  # behind it: the batch holds one row
        assert running.started.wait(60)
        engine.drain(0)
        assert running.ended.wait(60) and waiting.ended.wait(60)
        with pytest.raises(ShuttingDown, match="shut down before this request finished"):
            engine.call(lambda: 1).result(60)  # the playground's rescoring, past the deadline: refused too
    finally:
        engine.stop()
    for events in (running, waiting):
        assert not done(events)
        (failed,) = [e for e in events if isinstance(e, JobFailed)]
        assert failed is events[-1] and failed.status == 503 and "shut down before this request finished" in \
            failed.message
    assert engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0
