"""TRL's SFTTrainer: refused on CausalQwen (its fused softmax head skips the model), and CausalQwenSFTTrainer, which
trains the model's own loss with its numbers on text, prompt/completion and conversational datasets."""

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from causal_qwen import CausalQwenForCausalLM, CausalQwenTokenizer  # noqa: E402
from causal_qwen.data import tokenize_examples  # noqa: E402
from causal_qwen.integrations.trl import CausalQwenSFTTrainer  # noqa: E402
from causal_qwen.metrics import CausalQwenMetrics  # noqa: E402

pytestmark = pytest.mark.slow

TEXTS = [f"A box of {i + 2} apples costs {3.5 * (i + 1)} dollars." for i in range(8)]
PAIRS = [{"prompt": f"A kilo costs {i + 1.5} dollars, so {i + 2} kilos cost", "completion": f" {(i + 1.5) * (i + 2)}."}
         for i in range(8)]


@pytest.fixture(scope="module")
def tokenizer(qwen25_dir):
    return CausalQwenTokenizer.from_pretrained(qwen25_dir)


@pytest.fixture
def model(tokenizer):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    return CausalQwenForCausalLM.from_qwen(qwen, tokenizer=tokenizer, ovr_threshold=1.0, abduction_scale_init=0.1)


def config(tmp_path, **overrides) -> SFTConfig:
    fields = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                  learning_rate=1e-2, bf16=False, report_to=[], save_strategy="no", logging_steps=1, use_cpu=True,
                  disable_tqdm=True, train_sampling_strategy="sequential", dataloader_pin_memory=False, max_length=64)
    fields.update(overrides)
    return SFTConfig(**fields)


def test_plain_sft_trainer_is_refused(model, tokenizer, tmp_path):
    # Its fused head runs the bare backbone and a softmax over cls_head: numbers, abduction and OvR loss skipped.
    with pytest.raises(ValueError, match="CausalQwenSFTTrainer"):
        SFTTrainer(model=model, args=config(tmp_path), train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]),
                   processing_class=tokenizer)
    assert "forward" not in vars(model)  # the model's own forward is in place


@pytest.mark.parametrize("kind", ["text", "pairs"])
def test_sft_trainer_reports_the_model_loss_and_feeds_the_numbers(model, tokenizer, tmp_path, kind):
    rows = [{"text": t} for t in TEXTS] if kind == "text" else [dict(pair) for pair in PAIRS]
    # A text or completion that ends with the end-of-sequence token gets it once, as TRL does.
    rows[1] = {k: v + tokenizer.eos_token if k in ("text", "completion") else v for k, v in rows[1].items()}
    trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path, max_steps=1), processing_class=tokenizer,
                                   train_dataset=Dataset.from_list(rows), value_head_start=False)
    assert "forward" not in vars(model)
    # The dataset keeps the numbers; a pair is labelled on its completion only, as tokenize_examples labels it.
    features = [trainer.train_dataset[i] for i in range(4)]
    if kind == "pairs":
        expected = tokenize_examples(tokenizer, PAIRS[:4], max_length=64)
    else:
        expected = tokenize_examples(tokenizer, [t + tokenizer.eos_token for t in TEXTS[:4]])
    for got, want in zip(features, expected, strict=True):
        assert {k: got[k] for k in want} == want
    values = [v for f in features for v in f["numeric_values"] if v != 0]
    assert len(values) == (8 if kind == "text" else 12)  # two numbers per text, three per pair

    batch = trainer.data_collator(features)
    model.train()
    with torch.no_grad():
        own = model(**batch).loss.item()
    seen = []
    hook = model.numeric_embedding.register_forward_pre_hook(lambda module, args: seen.append(args[2].clone()))
    trainer.train()
    hook.remove()
    (logged,) = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == pytest.approx(own, rel=1e-5)
    # The numbers reached the model with their values.
    assert sorted(v for v in seen[0].flatten().tolist() if v != 0) == sorted(values)


def test_sft_trainer_trains_the_causal_modules(model, tokenizer, tmp_path):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = CausalQwenMetrics(model)
    trainer = CausalQwenSFTTrainer(
        model=model, args=config(tmp_path, max_steps=4, eval_strategy="no"), processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]), eval_dataset=Dataset.from_list(PAIRS[:4]),
        compute_metrics=metrics.compute_metrics, preprocess_logits_for_metrics=metrics.preprocess_logits_for_metrics)
    trainer.train()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    # The value head moved by its start from the data; the decisions and b_noise trained.
    for name in ("action.reg_head.weight", "action.reg_head.bias", "action.b_noise", "action.cls_head.weight"):
        assert name in moved, name
    # The features the value reads are held by default (CausalQwenTrainer's train_value_features=False).
    for name in ("abduction.loc_net.weight", "abduction.scale_net.bias", "numeric_embedding.w_num",
                 "numeric_embedding.d_num"):
        assert name not in moved, name
    assert not any(n.startswith("model.") for n in moved)  # the backbone stays frozen
    assert model.config.value_head_fit is not None  # the value head started from the data
    logged = [entry for entry in trainer.state.log_history if "cls_loss_mean" in entry]
    assert len(logged) == 4 and all(entry["reg_loss_effective"] > 0 for entry in logged)
    result = trainer.evaluate()
    for key in ("eval_loss", "eval_accuracy", "eval_reg_mae", "eval_num_f1"):
        assert key in result, key


def test_conversational_data_is_rendered_with_its_numbers(model, tokenizer, tmp_path):
    messages = [{"messages": [{"role": "user", "content": "What is 2.5 times 4?"},
                              {"role": "assistant", "content": "It is 10."}]}] * 4
    pairs = [{"prompt": [{"role": "user", "content": "What is 2.5 times 4?"}],
              "completion": [{"role": "assistant", "content": "It is 10."}]}] * 4
    for rows in (messages, pairs):
        trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path, max_steps=1, max_length=None),
                                       processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                                       value_head_start=False)
        feature = trainer.train_dataset[0]
        assert sorted(v for v in feature["numeric_values"] if v) == [2.5, 4.0, 10.0]
        assert tokenizer.decode(feature["input_ids"], numeric_values=feature["numeric_values"]).endswith(
            "It is 10.<|im_end|>\n")
        if rows is pairs:
            start = next(i for i, label in enumerate(feature["labels"]) if label != -100)
            assert tokenizer.decode(feature["input_ids"][start:], numeric_values=feature["numeric_values"][start:]
                                    ).startswith("It is 10.")
        trainer.train()


@pytest.mark.parametrize("option", [{"packing": True}, {"padding_free": True}, {"loss_type": "dft"}])
def test_options_that_would_drop_the_numbers_or_the_loss_are_refused(model, tokenizer, tmp_path, option):
    with pytest.raises(ValueError, match="not supported"):
        CausalQwenSFTTrainer(model=model, args=config(tmp_path, **option), processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]))


def test_lora_through_peft_config_trains_adapters_and_causal_modules(model, tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                      modules_to_save=["numeric_embedding", "abduction", "action"])
    trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path, max_steps=2), processing_class=tokenizer,
                                   train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]), peft_config=lora,
                                   train_value_features=True)
    # Every parameter: the value read-out is held out of the optimizer until training ends, then refitted.
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    moved = {n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])}
    for part in ("lora_A", "abduction.modules_to_save", "reg_head", "numeric_embedding.modules_to_save"):
        assert any(part in n for n in moved), part


def test_sft_trainer_keeps_the_value_side_of_the_start(model, tokenizer, tmp_path):
    # CausalQwenTrainer's default: the read-out and the features it reads are held out of the optimizer, so with the
    # frozen backbone the value side is the start's and nothing is refitted; the class decisions train.
    data = Dataset.from_list([dict(pair) for pair in PAIRS])
    trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path, max_steps=2), processing_class=tokenizer,
                                   train_dataset=data)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(model.action.reg_head.weight), id(model.numeric_embedding.w_num),
                            id(model.abduction.loc_net.weight)}
    assert id(model.action.cls_head.weight) in optimized and trainer.value_head_start.refits == []
    assert model.config.value_head_fit is not None and model.action.reg_head.weight.requires_grad
    # With the features trained, the read-out is fitted again to them at the end.
    trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path / "features", max_steps=2),
                                   processing_class=tokenizer, train_dataset=data, train_value_features=True)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.action.reg_head.weight) not in optimized and id(model.numeric_embedding.w_num) in optimized
    # (Step 0: the model was fitted before this trainer, so the start's score for the end's comparison is a refit.)
    assert [step for step, _ in trainer.value_head_start.refits] == [0, 2]


def test_a_plain_qwen_tokenizer_trains_text_only(model, qwen25_dir, tmp_path, caplog):
    # A TRL user's tokenizer is often the base model's: numbers then stay digits (numeric_values 0, no <NUM>), the
    # value-head start is skipped, and a warning names the tokenizer that trains the numbers.
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(qwen25_dir)
    with caplog.at_level("WARNING", logger="causal_qwen"):
        trainer = CausalQwenSFTTrainer(model=model, args=config(tmp_path, max_steps=2), processing_class=plain,
                                       train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]))
        trainer.train()
    feature = trainer.train_dataset[0]
    assert feature["input_ids"] == plain(TEXTS[0])["input_ids"] + [plain.eos_token_id]
    assert feature["numeric_values"] == [0.0] * len(feature["input_ids"])
    assert trainer.state.global_step == 2 and model.config.value_head_fit is None
    messages = [r.getMessage() for r in caplog.records]
    assert sum("does not read numbers" in m and "CausalQwenTokenizer" in m for m in messages) == 1
    assert sum("value head start skipped" in m for m in messages) == 1


def test_an_empty_dataset_is_refused_by_name(model, tokenizer, tmp_path):
    empty = Dataset.from_list([{"text": TEXTS[0]}]).select([])
    with pytest.raises(ValueError, match="train_dataset holds no examples"):
        CausalQwenSFTTrainer(model=model, args=config(tmp_path), processing_class=tokenizer, train_dataset=empty)
    with pytest.raises(ValueError, match="eval_dataset holds no examples"):
        CausalQwenSFTTrainer(model=model, args=config(tmp_path), processing_class=tokenizer,
                             train_dataset=Dataset.from_list([{"text": t} for t in TEXTS]), eval_dataset=empty)
