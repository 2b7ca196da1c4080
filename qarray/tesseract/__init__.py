"""qarray.tesseract: what any Tesseract built on qarray reuses.

- ``Settings``: every ``QARRAY_*`` variable, read and checked once;
- ``Runtime``: the settings, the mesh, the resident model and the residual
  cache of one API module (``RUNTIME = Runtime.from_env()``);
- ``Limits``: request size limits as schema validators and endpoint checks;
- ``ResidualCache``: apply's pullback kept for the VJP that follows;
- ``Batcher``, ``Rows``: concurrent requests on a resident model merged
  along their rows into one compiled call (dynamic batching);
- ``ModelTesseract``: any equinox model, quantized and resident, as a
  Tesseract with all five endpoints (a user's ``tesseract_api.py`` in a few
  lines: ``examples/cnn_surrogate/``);
- ``jit_request``: an endpoint function of the request dict, compiled;
- ``RequestGuard``, ``create_app``, ``main``: the guarded server
  (``qarray-serve``); ``shared_memory_tesseract``: it on one host, arrays
  passed through shared memory (binref files on a tmpfs);
- ``install_gradient_path_check``: the tesseract-core workarounds, in one
  module (``qarray.tesseract._workarounds``).

Needs tesseract-core's runtime (``pip install qarray[tesseract]``); ``import
qarray`` does not import this package.
"""

from ._batching import Batcher as Batcher
from ._batching import Rows as Rows
from ._cache import ResidualCache as ResidualCache
from ._guard import RequestGuard as RequestGuard
from ._guard import binref_problem as binref_problem
from ._guard import check_body as check_body
from ._jit import jit_request as jit_request
from ._limits import Limits as Limits
from ._limits import declared_shape as declared_shape
from ._limits import first_index as first_index
from ._limits import quantized_payload as quantized_payload
from ._limits import require_at_least as require_at_least
from ._limits import require_finite as require_finite
from ._local import shared_memory_tesseract as shared_memory_tesseract
from ._mesh import make_mesh as make_mesh
from ._mesh import on_mesh as on_mesh
from ._model import ModelTesseract as ModelTesseract
from ._paths import lookup_path as lookup_path
from ._requests import checked_vectors as checked_vectors
from ._requests import unprocessable as unprocessable
from ._resident import load_resident as load_resident
from ._runtime import Runtime as Runtime
from ._server import create_app as create_app
from ._server import keep_freed_memory as keep_freed_memory
from ._server import main as main
from ._settings import Settings as Settings
from ._settings import SettingsError as SettingsError
from ._workarounds import install_gradient_path_check as install_gradient_path_check
