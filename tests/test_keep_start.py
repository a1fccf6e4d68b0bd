"""Training keeps the value head's start: the read-out held out of the optimizer and refitted to the trained loc_U
(before evaluations, checkpoints and at the end), and the `<NUM>` decision started from the prompt's own next tokens."""

import copy
import math

import datasets
import pytest
import torch
from ddp_worker import NUM, dataset
from transformers import Trainer, TrainerCallback, TrainingArguments

from causal_qwen import CausalQwenForCausalLM
from causal_qwen.cauchy import symlog
from causal_qwen.data.collator import CausalQwenDataCollator
from causal_qwen.starts import fit_value_head, known_next_tokens, ridge_readout
from causal_qwen.training import CausalQwenTrainer, ValueHeadStartCallback


def fresh(tiny_qwen, context_values: bool = False) -> CausalQwenForCausalLM:
    """The model of the linear read-out alone by default (the context-value path has a test of its own below)."""
    return CausalQwenForCausalLM.from_qwen(tiny_qwen, num_token_id=NUM, ovr_threshold=1.0, abduction_scale_init=0.1,
                                           context_values=context_values)


def related(n: int, seed: int) -> list[dict]:
    """Texts whose second number is a function of the first (so a read-out of loc_U has something to find)."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        ids = torch.randint(1, 100, (10,), generator=g)
        ids[3] = ids[7] = NUM
        first = float(torch.rand((), generator=g, dtype=torch.float64)) * 100
        values = [0.0] * 10
        values[3], values[7] = first, 3.0 * first + 5.0
        examples.append({"input_ids": ids.tolist(), "numeric_values": values})
    return examples


def keyed(n: int, seed: int) -> list[dict]:
    """Texts whose second number is set by the word before it, one of four, and not by the first number: the
    linear read-out of loc_U finds it and no candidate of the context-value path can (each reads the earlier value)."""
    g = torch.Generator().manual_seed(seed)
    keys = {11: 10.0, 22: 40.0, 33: 160.0, 44: 640.0}
    examples = []
    for _ in range(n):
        ids = torch.randint(1, 100, (10,), generator=g)
        ids[3] = ids[7] = NUM
        ids[6] = list(keys)[int(torch.randint(0, 4, (), generator=g))]
        values = [0.0] * 10
        values[3] = float(torch.rand((), generator=g, dtype=torch.float64)) * 100
        values[7] = keys[int(ids[6])] * (1.0 + 0.02 * float(torch.randn((), generator=g, dtype=torch.float64)))
        examples.append({"input_ids": ids.tolist(), "numeric_values": values})
    return examples


def args(tmp_path, steps: int, **kw) -> TrainingArguments:
    kw = {"save_strategy": "no", "seed": 0, "train_sampling_strategy": "sequential", **kw}
    return TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, per_device_eval_batch_size=8,
                             max_steps=steps, learning_rate=1e-2, report_to=[], logging_steps=1, use_cpu=True,
                             disable_tqdm=True, **kw)


@torch.no_grad()
def eval_forward(model, data: list[dict]):
    """The model's outputs on the collated texts in eval mode, the positions whose next label is <NUM>, and the
    symlog of their next values."""
    batch = CausalQwenDataCollator(0)(data)
    was_training = model.training
    model.eval()
    out = model(batch["input_ids"], numeric_values=batch["numeric_values"], attention_mask=batch["attention_mask"])
    model.train(was_training)
    where = batch["labels"][:, 1:] == NUM
    return out, where, symlog(batch["numeric_values"][:, 1:][where].double())


def value_rows(model, data: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """loc_U where the next token is a labelled <NUM>, and symlog of its value: the rows of the read-out."""
    out, where, y = eval_forward(model, data)
    return out.loc_U[:, :-1][where].double(), y


def assert_readout_is_the_ridge_of(model, data: list[dict]) -> None:
    weight, bias, _, error = ridge_readout(*value_rows(model, data))
    torch.testing.assert_close(model.action.reg_head.weight[0].double(), weight, rtol=1e-4, atol=1e-6)
    assert model.action.reg_head.bias.item() == pytest.approx(bias, rel=1e-4, abs=1e-6)
    assert model.action.reg_log_noise.exp().item() == pytest.approx(error, rel=1e-4)


def value_nll(model, data: list[dict]) -> float:
    """Mean Cauchy NLL of the true next value (symlog space) at the labelled <NUM> targets, ungated."""
    x, y = value_rows(model, data)
    with torch.no_grad():
        loc, scale = model.action.regress(x.float(), torch.zeros_like(x).float())
    loc, scale = loc.double(), scale.double()
    return (torch.log(math.pi * scale) + torch.log1p(((y - loc) / scale) ** 2)).mean().item()


class AtStart(TrainerCallback):
    """The held-out value NLL right after the start (before the first step)."""

    def __init__(self, held_out):
        self.held_out, self.nll = held_out, None

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if self.nll is None:
            self.nll = value_nll(model, self.held_out)


def value_side_parameters(model) -> dict[str, torch.Tensor]:
    """Everything loc_Y reads apart from the frozen backbone: the numeric embedding, the abduction network (with the
    context-value path) and the read-out, by name."""
    owners = ("numeric_embedding.", "abduction.", "action.reg_head.", "action.reg_log_noise")
    return {name: param for name, param in model.named_parameters() if name.startswith(owners)}


@pytest.mark.parametrize("context_values", [False, True])
@pytest.mark.parametrize("learning", [True, False])
def test_training_keeps_the_features_out_of_the_optimizer_and_trains_the_decisions(tiny_qwen, tmp_path,
                                                                                   context_values, learning):
    """By default the value read-out and the features it reads are held out of the optimizer: the read-out learns
    on the start's rows by its own steps (starts/learning.py) and its widths follow, the features and the rest of the
    path stay the start's, and the class decisions learn. With `value_learning=None` the model predicts every
    held-out value's location after training exactly as right after the start, with no refit."""
    train, held_out = related(256, seed=1), related(64, seed=2)
    model = fresh(tiny_qwen, context_values=context_values)
    at_start = {}

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not at_start:
                out = eval_forward(model, held_out)[0]
                at_start.update(loc_y=out.loc_Y.clone(), cls=model.action.cls_head.weight.detach().clone(),
                                nll=model_value_nll(model, held_out),
                                params={n: p.detach().clone() for n, p in value_side_parameters(model).items()})

    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 12), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0), callbacks=[Start()],
                                **({} if learning else {"value_learning": None}))
    value_side = value_side_parameters(model)
    assert {id(p) for p in trainer.value_head_start._held} == {id(p) for p in value_side.values()}
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(p) for p in value_side.values()}
    assert id(model.action.cls_head.weight) in optimized
    learner = trainer.value_head_start.learner
    assert (learner is not None) == learning
    learnt = learning and learner.record.best_step > 0
    # The widths follow what the read-out learnt: the path's width map, or γ_Y without the path.
    widths = ("abduction.context_values.width.",) if context_values else ("action.reg_log_noise",)
    for name, param in value_side.items():
        if learnt and name.startswith("action.reg_head"):
            assert not torch.equal(param.detach(), at_start["params"][name])  # the read-out learnt
        elif learnt and name.startswith(widths):
            assert torch.isfinite(param).all()
        else:
            torch.testing.assert_close(param.detach(), at_start["params"][name], rtol=0, atol=0, msg=name)
    assert not torch.equal(model.action.cls_head.weight, at_start["cls"])  # the decisions trained
    if learning:
        return
    torch.testing.assert_close(eval_forward(model, held_out)[0].loc_Y, at_start["loc_y"], rtol=0, atol=0)
    # The widths move only with b_noise (0.01x the head's rate, shared with the class decisions).
    assert model_value_nll(model, held_out) == pytest.approx(at_start["nll"], rel=1e-3)
    assert trainer.value_head_start.refits == [] and trainer.value_head_start.kept_trained_features is None
    assert all(param.requires_grad for param in value_side.values())  # given back for training outside
    with pytest.raises(TypeError, match="train_value_features"):
        CausalQwenTrainer(model=model, args=args(tmp_path, 1), train_dataset=train, train_value_features=1)


def test_training_the_features_from_the_start_does_not_raise_the_held_out_value_loss(tiny_qwen, tmp_path):
    train, held_out = related(256, seed=1), related(64, seed=2)
    model = fresh(tiny_qwen)
    start = AtStart(held_out)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 24), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0), callbacks=[start], train_value_features=True)
    held = trainer.value_head_start._held
    assert {id(p) for p in held} == {id(model.action.reg_head.weight), id(model.action.reg_head.bias),
                                     id(model.action.reg_log_noise)}
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not optimized & {id(model.action.reg_head.weight), id(model.action.reg_head.bias)}
    assert id(model.numeric_embedding.w_num) in optimized
    assert start.nll is not None and value_nll(model, held_out) <= start.nll
    assert trainer.value_head_start.kept_trained_features is not None  # the end compared the features with the start's
    # The read-out ends fitted to the trained loc_U, and trains again outside this trainer.
    assert_readout_is_the_ridge_of(model, train)
    assert [step for step, _ in trainer.value_head_start.refits] == [24]
    assert model.action.reg_head.weight.requires_grad and model.action.reg_log_noise.requires_grad
    with pytest.raises(TypeError, match="refit_value_readout"):
        CausalQwenTrainer(model=model, args=args(tmp_path, 1), train_dataset=train, refit_value_readout="yes")


def model_value_nll(model, data: list[dict]) -> float:
    """Mean Cauchy NLL of the true next value (symlog space) under the model's own loc_Y, scale_Y at the labelled
    <NUM> targets: with the context-value path, the value the model predicts."""
    out, where, y = eval_forward(model, data)
    loc, scale = out.loc_Y[:, :-1][where].double(), out.scale_Y[:, :-1][where].double()
    return (torch.log(math.pi * scale) + torch.log1p(((y - loc) / scale) ** 2)).mean().item()


def test_training_the_features_with_the_context_path_keeps_the_start(tiny_qwen, tmp_path):
    """The path (docs/design.md §1b) is held out of the optimizer with the read-out and refitted with it: after
    training the features the model's held-out value NLL is no worse than right after the start, the end-of-training
    check scoring the features on the evaluation data, which they never trained on."""
    train, held_out = related(256, seed=1), related(64, seed=2)
    model = fresh(tiny_qwen, context_values=True)
    at_start = {}

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not at_start:
                at_start.update(nll=model_value_nll(model, held_out), model=copy.deepcopy(model))

    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 24), train_dataset=train, eval_dataset=held_out,
                                data_collator=CausalQwenDataCollator(0), callbacks=[Start()],
                                train_value_features=True)
    path = set(map(id, model.abduction.context_values.parameters()))
    assert path <= {id(p) for p in trainer.value_head_start._held}
    trainer.train()
    assert not path & {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    fit = model.config.value_head_fit
    assert fit["context_step"] > 0 and fit["context_nll"] < fit["context_nll_linear"], fit
    final = model_value_nll(model, held_out)
    if trainer.value_head_start.kept_trained_features:
        # Kept only where they score no worse on the evaluation data, by this very NLL.
        assert final <= at_start["nll"] * (1 + 1e-12), (final, at_start["nll"])
    else:
        # Restored: the start's features and value side exactly (its medians), or a refit of them that scores better;
        # only b_noise moved, trained with the class decisions. (A lost start costs 0.03 or more.)
        start = at_start["model"]
        torch.testing.assert_close(eval_forward(start, held_out)[0].loc_Y, eval_forward(model, held_out)[0].loc_Y,
                                   rtol=0, atol=0)
        with torch.no_grad():
            start.action.b_noise.copy_(model.action.b_noise)
        assert final <= model_value_nll(start, held_out) * (1 + 1e-12)
        assert final <= at_start["nll"] * (1 + 1e-4)


def test_features_that_train_worse_than_the_start_are_restored(tiny_qwen, tmp_path):
    """Features that end worse for the value than at the start (here the abduction's map zeroed after the last step,
    as a bad run could leave it) come back to the start's, with the start's value side: the model then predicts
    held-out values exactly as right after the start. Features that end no worse are kept."""
    train, held_out = related(256, seed=1), related(64, seed=2)
    at_start = {}

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if not at_start:
                at_start.update(nll=model_value_nll(model, held_out), w_num=model.numeric_embedding.w_num.clone(),
                                loc_net=model.abduction.loc_net.weight.clone(),
                                loc_y=eval_forward(model, held_out)[0].loc_Y)

    class Scramble(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == state.max_steps:
                with torch.no_grad():  # loc_U no longer depends on z: the read-out has nothing left to read
                    model.abduction.loc_net.weight.zero_()

    model = fresh(tiny_qwen)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 6), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0), callbacks=[Start(), Scramble()],
                                train_value_features=True)
    trainer.train()
    assert trainer.value_head_start.kept_trained_features is False
    torch.testing.assert_close(model.numeric_embedding.w_num, at_start["w_num"], rtol=0, atol=0)
    torch.testing.assert_close(model.abduction.loc_net.weight, at_start["loc_net"], rtol=0, atol=0)
    # The value's location is the start's; its scale moves only with b_noise, which trains with the class decisions.
    torch.testing.assert_close(eval_forward(model, held_out)[0].loc_Y, at_start["loc_y"], rtol=1e-6, atol=1e-6)
    assert model_value_nll(model, held_out) == pytest.approx(at_start["nll"], rel=1e-3)
    assert [step for step, _ in trainer.value_head_start.refits] == [6]

    # Features that end no worse are kept: here the abduction's map ends as it began, and w_num as trained (at a
    # millionth of the rate, so that the value sees nothing of it). The read-out alone, whose refit is a ridge: a
    # refit of the context-value path from the same features scored 1.0010 and 1.0372 against the start's 1.0254 and
    # 1.0355 with one and two threads, a coin that this test cannot call.
    class Unmoved(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == state.max_steps:
                with torch.no_grad():
                    model.abduction.loc_net.weight.copy_(at_start["loc_net"])

    at_start.clear()
    model = fresh(tiny_qwen)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path / "kept", 6), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0), callbacks=[Start(), Unmoved()],
                                learning_rate_scales={"numeric_embedding": 1e-6, "action.cls_head": 1.0},
                                train_value_features=True)
    trainer.train()
    assert trainer.value_head_start.kept_trained_features is True
    assert not torch.equal(model.numeric_embedding.w_num, at_start["w_num"])


def test_restored_features_come_back_with_the_start_path(tiny_qwen, tmp_path):
    """Where the trained features are restored, the start's context-value path and read-out come back with them as
    they were: a refit fits the path from where it is, and from the path fitted to the trained features it can land
    in a minimum worse than the start's. Without evaluation data nothing is fitted again. The values are set by the
    word before them (`keyed`), which only the read-out of loc_U can see: with the abduction's map zeroed the trained
    features are worse whatever the path's refit finds (on `related` values the path alone computes them, and a refit
    of it from the zeroed features scored 1.033 against the start's 1.047 on one machine and worse on another)."""
    train = keyed(256, seed=1)
    model = fresh(tiny_qwen, context_values=True)
    path = model.abduction.context_values
    seen: dict = {"refits": []}

    def state() -> dict[str, torch.Tensor]:
        return {name: param.detach().clone() for name, param in path.named_parameters()}

    class Scramble(TrainerCallback):
        def on_step_begin(self, args, state_, control, model=None, **kwargs):
            seen.setdefault("start", state())
            seen.setdefault("readout", model.action.reg_head.weight.detach().clone())

        def on_step_end(self, args, state_, control, model=None, **kwargs):
            if state_.global_step == state_.max_steps:
                with torch.no_grad():
                    model.abduction.loc_net.weight.zero_()

    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 6), train_dataset=train,
                                data_collator=CausalQwenDataCollator(0), callbacks=[Scramble()],
                                train_value_features=True)
    refit = trainer.value_head_start._refit

    def recording_refit(model, step):
        before = state()
        refit(model, step)
        seen["refits"].append((before, state()))

    trainer.value_head_start._refit = recording_refit
    trainer.train()
    assert trainer.value_head_start.kept_trained_features is False
    [(_, fitted_to_trained)] = seen["refits"]  # the refit on the trained features; the restore fits nothing
    assert any(not torch.equal(value, seen["start"][name]) for name, value in fitted_to_trained.items())
    for name, value in state().items():
        torch.testing.assert_close(value, seen["start"][name], rtol=0, atol=0)
    torch.testing.assert_close(model.action.reg_head.weight, seen["readout"], rtol=0, atol=0)


def test_too_few_held_out_values_make_no_check_and_keep_the_trained_features(tiny_qwen, tmp_path, caplog):
    """40 texts give the path 80 rows, of which 16 are held out: too few to tell trained features from the start's
    (the path's fit on so few rows varies more than their difference), so even features as bad as the ones of the
    test above are kept, and the trainer says why."""

    class Scramble(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == state.max_steps:
                with torch.no_grad():
                    model.abduction.loc_net.weight.zero_()

    model = fresh(tiny_qwen, context_values=True)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 2), train_dataset=related(40, seed=1),
                                data_collator=CausalQwenDataCollator(0), callbacks=[Scramble()],
                                train_value_features=True)
    with caplog.at_level("WARNING", logger="causal_qwen.starts.callback"):
        trainer.train()
    assert model.config.value_head_fit["context_rows"] == 80
    assert trainer.value_head_start.kept_trained_features is None
    assert not model.abduction.loc_net.weight.any()
    assert any("16 held-out values are too few" in r.getMessage() for r in caplog.records)


def test_evaluations_and_checkpoints_see_the_refitted_readout_and_resume_keeps_it(tiny_qwen, tmp_path):
    train = related(32, seed=1)

    class AtEvaluation(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_evaluate(self, args, state, control, model=None, **kwargs):
            assert_readout_is_the_ridge_of(model, train)  # never a stale read-out at evaluation
            self.steps.append(state.global_step)

    run = dict(save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=3)
    evaluated = AtEvaluation()
    first = CausalQwenTrainer(model=fresh(tiny_qwen), args=args(tmp_path, 4, **run), train_dataset=train,
                              eval_dataset=train[:8], data_collator=CausalQwenDataCollator(0), callbacks=[evaluated],
                              train_value_features=True)
    first.train()
    assert evaluated.steps == [3, 4]
    assert [step for step, _ in first.value_head_start.refits] == [2, 3, 4]
    # The checkpoint of step 2 holds the read-out refitted to the model of step 2.
    saved = CausalQwenForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    assert_readout_is_the_ridge_of(saved, train)

    resumed_model = fresh(tiny_qwen)
    resumed = CausalQwenTrainer(model=resumed_model, args=args(tmp_path, 6, **run), train_dataset=train,
                                eval_dataset=train[:8], data_collator=CausalQwenDataCollator(0),
                                callbacks=[AtEvaluation()], train_value_features=True)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert resumed.value_head_start.fit is None  # the start is in the checkpoint
    assert [step for step, _ in resumed.value_head_start.refits] == [6]
    optimized = {id(p) for group in resumed.optimizer.param_groups for p in group["params"]}
    assert id(resumed_model.action.reg_head.weight) not in optimized
    assert_readout_is_the_ridge_of(resumed_model, train)


def test_plain_trainer_gets_the_start_and_the_refits_from_the_callback(tiny_qwen, tmp_path):
    train = related(32, seed=1)
    model = fresh(tiny_qwen)
    trainer = Trainer(model=model, args=args(tmp_path, 4, eval_strategy="steps", eval_steps=2),
                      train_dataset=train, eval_dataset=train[:8], data_collator=CausalQwenDataCollator(0))
    callback = ValueHeadStartCallback(trainer, train_features=True)
    trainer.add_callback(callback)
    assert not model.action.reg_head.weight.requires_grad  # held before Trainer builds its optimizer
    assert model.numeric_embedding.w_num.requires_grad
    trainer.train()
    assert callback.fit is not None and model.config.value_head_fit == callback.fit.to_dict()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.action.reg_head.weight) not in optimized
    assert [step for step, _ in callback.refits] == [2, 4]
    assert_readout_is_the_ridge_of(model, train)
    assert model.action.reg_head.weight.requires_grad
    with pytest.raises(TypeError, match="refit_readout"):
        ValueHeadStartCallback(trainer, refit_readout=None)
    with pytest.raises(TypeError, match="train_features"):
        ValueHeadStartCallback(trainer, train_features="no")
    # By default the callback holds the features the value reads too.
    ValueHeadStartCallback(trainer)
    assert not model.numeric_embedding.w_num.requires_grad and not model.abduction.loc_net.weight.requires_grad


def test_without_refit_the_readout_trains_as_before(tiny_qwen, tmp_path):
    model = fresh(tiny_qwen)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path, 2), train_dataset=related(16, seed=1),
                                data_collator=CausalQwenDataCollator(0), refit_value_readout=False)
    trainer.train()
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert id(model.action.reg_head.weight) in optimized and trainer.value_head_start.refits == []


def known_by_hand(features: list[dict]) -> list[list[int]]:
    """For each text, the next token of each position where it is known: the label, or the next id where the
    text goes on (position t + 1 is part of the same text); -100 at the text's last position and on padding."""
    rows = []
    width = max(len(f["input_ids"]) for f in features)
    for f in features:
        ids, labels = f["input_ids"], f.get("labels", f["input_ids"])
        row = []
        for t in range(width):
            if t + 1 >= len(ids):
                row.append(-100)
            elif labels[t + 1] != -100:
                row.append(labels[t + 1])
            else:
                row.append(ids[t + 1])
        rows.append(row)
    return rows


def prompt_completion(n: int) -> list[dict]:
    """Prompts of different lengths (a number inside) whose completion is one number: labels on it only."""
    features = []
    for i, f in enumerate(related(n, seed=3)):
        length = 6 + i % 4  # the prompt ends before the <NUM> at index 7 ... 9 (its last id made <NUM>)
        ids = f["input_ids"][:length] + [NUM, 2]
        values = f["numeric_values"][:length] + [float(i + 1), 0.0]
        if length > 7:
            ids[7], values[7] = 50 + i, 0.0
        features.append({"input_ids": ids, "numeric_values": values,
                         "labels": [-100] * length + ids[length:]})
    return features


def test_the_num_decision_starts_from_the_prompts_next_tokens(tiny_qwen):
    features = prompt_completion(12)
    batch = CausalQwenDataCollator(0)(features)
    expected = torch.tensor(known_by_hand(features))
    assert torch.equal(known_next_tokens(batch), expected)
    # Labels alone have 2 positions per text (the <NUM> and the end); the prompt adds its own next tokens.
    assert int((batch["labels"][:, 1:] != -100).sum()) == 24
    known = expected != -100
    assert int(known.sum()) == sum(len(f["input_ids"]) - 1 for f in features)
    assert int((expected == NUM).sum()) == 24  # the prompt's <NUM> at index 3 and the completion's

    # The fit: texts whose prompt (labels -100 on positions 0-4) holds a <NUM> at index 3 and whose labelled part
    # holds one at index 7. Labels alone give 4 positions per text, one <NUM>; the prompt adds 5, one <NUM>.
    features = dataset(16)
    for f in features:
        f["labels"] = [-100] * 5 + f["input_ids"][5:]
    batch = CausalQwenDataCollator(0)(features)
    expected = torch.tensor(known_by_hand(features))
    assert torch.equal(known_next_tokens(batch), expected)
    known = expected != -100
    assert int(known.sum()) == 16 * 9 and int((expected == NUM).sum()) == 32
    model = fresh(tiny_qwen)

    def num_f1() -> float:
        # Standard mode through the full forward at the independently chosen positions.
        with torch.no_grad():
            scores = model(batch["input_ids"], numeric_values=batch["numeric_values"],
                           attention_mask=batch["attention_mask"])
        p = model.ovr_probabilities(scores.loc_S.double(), scores.scale_S.double())
        chosen, truth = (p.argmax(-1) == NUM)[known], (expected == NUM)[known]
        return 2 * (chosen & truth).sum().item() / (chosen.sum() + truth.sum()).item()

    before = num_f1()
    fit = fit_value_head(model, [batch], num_row_penalty=1.0)
    assert fit.positions == 16  # the value rows stay the labelled <NUM> positions
    assert fit.num_positions == 16 * 9
    assert fit.num_f1_before == pytest.approx(before, abs=1e-9)
    assert fit.num_f1_after == pytest.approx(num_f1(), abs=1e-9)
    assert fit.num_f1_after > fit.num_f1_before
    # Standard mode now picks <NUM> before the prompt's number too, which no label marks.
    with torch.no_grad():
        scores = model(batch["input_ids"], numeric_values=batch["numeric_values"])
    p = model.ovr_probabilities(scores.loc_S.double(), scores.scale_S.double())
    assert (p[:, 2].argmax(-1) == NUM).double().mean().item() > 0.5


def scaled(n: int, seed: int) -> list[dict]:
    """Texts of another source than `related`: other words, values in the thousands, the second a hundredth of the
    first."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(n):
        ids = torch.randint(100, 120, (10,), generator=g)
        ids[3] = ids[7] = NUM
        first = 1000.0 + float(torch.rand((), generator=g, dtype=torch.float64)) * 1000
        values = [0.0] * 10
        values[3], values[7] = first, first / 100
        examples.append({"input_ids": ids.tolist(), "numeric_values": values})
    return examples


def start_reading(tiny_qwen, tmp_path, monkeypatch, train: list[dict], sampling: str) -> tuple[list, list, object]:
    """Train 2 steps with the start's cap at 40 value rows (20 texts here): the texts the start and the first refit
    read (their first three ids, in order) and the trained model."""
    import causal_qwen.starts.callback as training

    read = []

    def spy(fit):
        def wrapped(model, batches, **kw):
            ids = []

            def recorded():
                for batch in batches:
                    ids.extend(tuple(row[:3].tolist()) for row in batch["input_ids"])
                    yield batch
            result = fit(model, recorded(), **kw)
            read.append(ids)
            return result
        return wrapped

    monkeypatch.setattr(training, "start_value_side", spy(training.start_value_side))
    monkeypatch.setattr(training, "refit_value_readout", spy(training.refit_value_readout))
    model = fresh(tiny_qwen)
    trainer = CausalQwenTrainer(model=model, args=args(tmp_path / sampling, 2, train_sampling_strategy=sampling,
                                                       seed=3),
                                train_dataset=train, data_collator=CausalQwenDataCollator(0),
                                train_value_features=True)
    trainer.value_head_start.max_positions = 40
    state = torch.get_rng_state()
    trainer.value_head_start._train_rows()
    assert torch.equal(torch.get_rng_state(), state)  # training's shuffle is left alone
    trainer.train()
    monkeypatch.undo()
    return read[0], read[1], model


def test_the_start_reads_a_sample_of_data_sorted_by_source(tiny_qwen, tmp_path, monkeypatch):
    """Data concatenated from two sources, more value rows than the start's cap: the start and every refit read the
    same sample of both, in the order of the texts' own content, whatever the sampling of training and whatever order
    the data comes in; so the start's intervals cover both sources."""
    first, second = related(64, seed=1), scaled(64, seed=2)
    train = first + second
    in_order = [tuple(ex["input_ids"][:3]) for ex in train]
    sources = {ids: i >= len(first) for i, ids in enumerate(in_order)}
    held_out = scaled(32, seed=5) + related(32, seed=6)
    reads = {}
    for sampling in ("sequential", "random"):
        start, refit, model = start_reading(tiny_qwen, tmp_path, monkeypatch, train, sampling)
        # The start reads every text for the <NUM> decision's positions and keeps the value rows of the first 20;
        # the refit stops at the batch that brings the cap in.
        assert 20 <= len(refit) < len(train) / 2 and refit == start[:len(refit)]
        assert sorted(start) == sorted(in_order) and start != in_order
        share = sum(sources[ids] for ids in start[:20]) / 20
        assert 0.3 < share < 0.7
        x, y = value_rows(model, held_out)
        with torch.no_grad():
            loc, scale = model.action.regress(x.float(), torch.zeros_like(x).float())
        inside = ((loc.double() - y).abs() < scale.double()).double()  # in the 50% interval, loc ± scale
        assert inside[:64].mean() > 0.15 and inside[64:].mean() > 0.15  # each source's values
        reads[sampling] = start
    assert reads["sequential"] == reads["random"]
    # The data in another order, or as a datasets.Dataset (with a column the model does not take, which Trainer
    # drops), is read in the same order.
    assert start_reading(tiny_qwen, tmp_path / "reversed", monkeypatch, train[::-1], "random")[0] == reads["random"]
    table = datasets.Dataset.from_list([{**ex, "source": "second" if sources[ids] else "first"}
                                        for ex, ids in zip(train, in_order, strict=True)])
    assert start_reading(tiny_qwen, tmp_path / "table", monkeypatch, table, "random")[0] == reads["random"]


@pytest.mark.parametrize("as_read", [0.25, None])
def test_the_end_check_scores_a_start_by_the_nll_that_chose_its_path(as_read):
    """The end-of-training check of trained features compares the start's and the last refit's held-out scores: with
    the context-value path, the NLL on the held-out rows as read that chose the path (`context_nll_as_read`), and in
    a record saved before that field, `context_nll`; on a fifth of the rows, rounded up (every fifth held out). Without
    the path, the read-out's leave-one-out error on every row."""
    from causal_qwen.starts import ValueHeadFit
    from causal_qwen.starts.callback import _held_out_score

    fit = ValueHeadFit(positions=12, penalty=1.0, loo_median_abs_error=0.5, regression_noise=0.5, context_rows=12,
                       context_nll_linear=2.0, context_nll=1.0, context_nll_as_read=as_read)
    assert _held_out_score(fit) == (1.0 if as_read is None else as_read, 3)
    without = ValueHeadFit(positions=12, penalty=1.0, loo_median_abs_error=0.5, regression_noise=0.5)
    assert _held_out_score(without) == (0.5, 12)


def test_the_start_is_the_same_with_one_thread_and_with_two(tiny_qwen):
    """The start's fits run on one thread each (`context_start.one_thread`; the path's random starts side by side on
    the caller's threads), so the order of their float64 sums, and with it the fit kept, does not follow the caller's
    thread count. With each fit on the caller's threads, the two starts here differ in the last bits (the read-out's
    leave-one-out error 0.633971924167076 and ...0765), and the fit amplifies such bits: a refit of the path on other
    rows scored 1.0010 with one thread and 1.0372 with two."""
    data = related(96, seed=3)
    batches = [CausalQwenDataCollator(0)(data[i:i + 16]) for i in range(0, len(data), 16)]
    threads = torch.get_num_threads()
    fitted = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            model = fresh(tiny_qwen, context_values=True)
            record = fit_value_head(model, batches).to_dict()
            assert torch.get_num_threads() == count  # the caller's count comes back
            state = {name: tensor.clone() for name, tensor in model.state_dict().items()
                     if name.startswith(("action.", "abduction.context_values"))}
            fitted.append((record, state))
    finally:
        torch.set_num_threads(threads)
    (record_1, state_1), (record_2, state_2) = fitted
    assert record_1 == record_2
    assert state_1.keys() == state_2.keys()
    for name in state_1:
        assert torch.equal(state_1[name], state_2[name]), name
