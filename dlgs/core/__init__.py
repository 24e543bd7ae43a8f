"""Framework-free core of dlgs: threshold controllers, error-feedback exchange,
wire format and cross-rank checks. Imports no torch, TensorFlow or Horovod."""

from .backend import ArrayOps
from .checkpoint import STATE_VERSION
from .config import Controller, IndexCoding, MergeConfig, SparsityConfig, ValueDType
from .consistency import RankMismatchError, describe_mismatch, signature
from .controller import ThresholdController, make_controller
from .engine import Engine
from .exchange import Collectives, SparseExchange
from .records import StepRecord, StepTrace
from .selection import select
from .wire import GroupLayout, LayerPlan, LayoutMismatchError, plan_layers

__all__ = [
    "ArrayOps",
    "Collectives",
    "Controller",
    "Engine",
    "GroupLayout",
    "IndexCoding",
    "LayerPlan",
    "LayoutMismatchError",
    "MergeConfig",
    "RankMismatchError",
    "STATE_VERSION",
    "SparseExchange",
    "SparsityConfig",
    "StepRecord",
    "StepTrace",
    "ThresholdController",
    "ValueDType",
    "describe_mismatch",
    "make_controller",
    "plan_layers",
    "select",
    "signature",
]
