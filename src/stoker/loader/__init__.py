"""The loader: ``from stoker.loader import Loader, OrderOption`` as in FFCV."""

from stoker.loader.loader import HeldBatchesWarning, Loader
from stoker.loader.mixing import Stream
from stoker.loader.order import OrderOption

__all__ = ["HeldBatchesWarning", "Loader", "OrderOption", "Stream"]
