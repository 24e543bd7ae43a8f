"""Framework-free core of dlgs: threshold controllers, error-feedback exchange,
wire format and cross-rank checks. Imports no torch, TensorFlow or Horovod."""

from .backend import ArrayOps
from .config import Controller, IndexCoding, MergeConfig, SparsityConfig, ValueDType
from .engine import Engine
from .exchange.exchange import Collectives, SparseExchange
from .exchange.records import StepRecord, StepTrace
from .selection.controller import ThresholdController, make_controller
from .selection.select import select
from .state.checkpoint import STATE_VERSION
from .state.consistency import RankMismatchError, describe_mismatch, signature
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
