"""The KServe v2 model-repository extension's rules, shared by its gRPC half (serving/protocols/grpc/kserve.py) and its
REST half (serving/protocols/http/routes.py): who may load and unload, and what the index says. The work is
serving/model/models.py's.

The API is behind the server's bearer token like every call but health's (serving/limits/admission.py). Loading and
unloading change what every client gets, so on a server without a token they are refused (PERMISSION_DENIED, 403)
unless repository_api_open says the port is reachable only by who may change the model; the index stays readable as
metadata does. With model_control none they are refused too (FAILED_PRECONDITION): the server was started to keep
what it loaded.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from serving.config import ServerConfig
from serving.errors import InvalidInput, LoadFailed, PermissionDenied
from serving.model.models import Models


class RepositoryApi:
    """RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload, without a protocol."""

    def __init__(self, models: Models, cfg: ServerConfig) -> None:
        self.models, self.cfg = models, cfg
        # Where an event loop runs loads and unloads (they wait for a drain, up to grace_s, one at a time): threads of
        # their own, so that they never hold the loop's pool, which long model calls use (http/exchange.py).
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="repository")

    def index(self, repository: str = "", ready_only: bool = False) -> list[dict[str, str]]:
        self._one_repository(repository)
        return self.models.index(ready_only)

    def load(self, name: str, repository: str = "") -> None:
        """Blocks until the model's versions are loaded (seconds): an event loop runs it in a thread."""
        self._may_change(name, repository)
        self.models.load(name)

    def unload(self, name: str, repository: str = "") -> None:
        """Blocks until the model's versions have drained (up to grace_s)."""
        self._may_change(name, repository)
        self.models.unload(name)

    def _may_change(self, name: str, repository: str) -> None:
        self._one_repository(repository)
        if self.cfg.auth_token is None and not self.cfg.repository_api_open:
            raise PermissionDenied("loading and unloading models needs the server's bearer token: start it with "
                                   "--auth-token-file (or SENTIMENT_AUTH_TOKEN), or with --repository-api-open "
                                   "where only trusted clients reach the port")
        if self.cfg.model_repository is None:
            raise LoadFailed("this server holds one bundle given on its command line: start it with "
                             "--model-repository DIR to load and unload models")
        if self.cfg.model_control == "none":
            raise LoadFailed("model_control is none: this server keeps the models it loaded at start; start it with "
                             "--model-control explicit or poll")
        if not name:
            raise InvalidInput("model_name: empty; name the model (its folder in the repository)")

    @staticmethod
    def _one_repository(repository: str) -> None:
        if repository:
            raise InvalidInput(f"repository_name {repository[:80]!r}: this server has one repository; leave it empty")
