"""The value side's start from data and its training (docs/design.md §1b, §1c, §7, §7b), in one package.

Read top to bottom:

- [`readout`](readout.py): one pass over the training data reads the value rows (loc_U where the next label is
  `<NUM>`, in an order of their own content), fits the ridge read-out and the `<NUM>` decision, then the path
  (`fit_value_head`, `start_value_side`, `refit_value_readout`, `read_value_rows`), and for a checkpoint on new
  data, its value side or one fitted afresh, whichever reads the new rows better
  ([`new_data`](new_data.py): `start_on_new_data`).
- [`path`](path.py): the context-value path's fit on the rows' leading principal coordinates, the read-out's guard of
  §1c, and the widths' calibration.
- [`learning`](learning.py): the read-out trained by gradient from its start on the rows the start read, in whitened
  coordinates, the held-out best kept (`ValueLearning`, `ValueLearner`).
- [`callback`](callback.py): all of it through training (`ValueHeadStartCallback`), for `CausalQwenTrainer`, the CLI,
  TRL and plain `Trainer`.
"""

from .callback import (
    DEFAULT_VALUE_LEARNING,
    ValueHeadStartCallback,
    parameter_path,
    readout_parameters,
    value_side_parameters,
)
from .learning import FOLDS, LearningRecord, LearningRows, ValueLearner, ValueLearning
from .new_data import start_on_new_data
from .readout import (
    NotEnoughNumbersError,
    ValueHeadFit,
    ValueStart,
    fit_value_head,
    known_next_tokens,
    num_decision_start,
    read_value_rows,
    refit_value_readout,
    ridge_readout,
    start_value_side,
)

__all__ = [
    "DEFAULT_VALUE_LEARNING",
    "FOLDS",
    "LearningRecord",
    "LearningRows",
    "NotEnoughNumbersError",
    "ValueHeadFit",
    "ValueHeadStartCallback",
    "ValueLearner",
    "ValueLearning",
    "ValueStart",
    "fit_value_head",
    "known_next_tokens",
    "num_decision_start",
    "parameter_path",
    "read_value_rows",
    "readout_parameters",
    "refit_value_readout",
    "ridge_readout",
    "start_on_new_data",
    "start_value_side",
    "value_side_parameters",
]
