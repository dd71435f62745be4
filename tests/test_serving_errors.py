"""serving/errors.py: each named error carries a gRPC status name that both protocols can map."""

from __future__ import annotations

import grpc
import pytest

from serving import errors
from serving.errors import NotReady, Retired, ServingError
from serving.protocols.http.errors import STATUS


def _serving_errors() -> list[type[ServingError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, ServingError)]


def test_status_codes_are_grpc_names() -> None:
    assert errors.STATUS_CODES == {c.name for c in grpc.StatusCode}


def test_every_error_has_a_grpc_code_and_an_http_status() -> None:
    for cls in _serving_errors():
        assert grpc.StatusCode[cls.code], cls
        assert cls.code in STATUS, f"{cls.__name__}: {cls.code} has no HTTP status (HTTP clients would get 500)"


def test_a_subclass_keeps_its_parents_code_unless_it_names_one() -> None:
    assert Retired.code == NotReady.code == "UNAVAILABLE"

    class Gone(Retired, code="NOT_FOUND"):
        pass

    assert Gone.code == "NOT_FOUND" and Retired.code == "UNAVAILABLE"


def test_a_code_that_is_not_a_grpc_name_is_refused_where_the_class_is_defined() -> None:
    with pytest.raises(ValueError, match="Typo: code 'UNAVAILIBLE' is not a grpc.StatusCode name"):
        class Typo(ServingError, code="UNAVAILIBLE"):
            pass
