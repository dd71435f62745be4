from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LongTextPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LONG_TEXT_POLICY_UNSPECIFIED: _ClassVar[LongTextPolicy]
    LONG_TEXT_POLICY_TRUNCATE: _ClassVar[LongTextPolicy]
    LONG_TEXT_POLICY_REFUSE: _ClassVar[LongTextPolicy]
LONG_TEXT_POLICY_UNSPECIFIED: LongTextPolicy
LONG_TEXT_POLICY_TRUNCATE: LongTextPolicy
LONG_TEXT_POLICY_REFUSE: LongTextPolicy

class ClassifyRequest(_message.Message):
    __slots__ = ("texts", "model_name", "model_version")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    model_name: str
    model_version: str
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("results", "model_name", "model_version")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Classification]
    model_name: str
    model_version: str
    def __init__(self, results: _Optional[_Iterable[_Union[Classification, _Mapping]]] = ..., model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class Classification(_message.Message):
    __slots__ = ("label", "label_index", "probabilities", "token_count", "truncated")
    LABEL_FIELD_NUMBER: _ClassVar[int]
    LABEL_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    label: str
    label_index: int
    probabilities: _containers.RepeatedScalarFieldContainer[float]
    token_count: int
    truncated: bool
    def __init__(self, label: _Optional[str] = ..., label_index: _Optional[int] = ..., probabilities: _Optional[_Iterable[float]] = ..., token_count: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class GetModelMetadataRequest(_message.Message):
    __slots__ = ("model_name", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...

class GetModelMetadataResponse(_message.Message):
    __slots__ = ("model_name", "labels", "max_tokens", "bundle_sha256", "execution_provider", "precision", "max_texts", "max_chars", "long_text_policy", "label_values", "probabilities_calibrated", "calibration_temperature", "model_card", "model_version")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_SHA256_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_PROVIDER_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHARS_FIELD_NUMBER: _ClassVar[int]
    LONG_TEXT_POLICY_FIELD_NUMBER: _ClassVar[int]
    LABEL_VALUES_FIELD_NUMBER: _ClassVar[int]
    PROBABILITIES_CALIBRATED_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_CARD_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    labels: _containers.RepeatedScalarFieldContainer[str]
    max_tokens: int
    bundle_sha256: str
    execution_provider: str
    precision: str
    max_texts: int
    max_chars: int
    long_text_policy: LongTextPolicy
    label_values: _containers.RepeatedScalarFieldContainer[str]
    probabilities_calibrated: bool
    calibration_temperature: float
    model_card: str
    model_version: str
    def __init__(self, model_name: _Optional[str] = ..., labels: _Optional[_Iterable[str]] = ..., max_tokens: _Optional[int] = ..., bundle_sha256: _Optional[str] = ..., execution_provider: _Optional[str] = ..., precision: _Optional[str] = ..., max_texts: _Optional[int] = ..., max_chars: _Optional[int] = ..., long_text_policy: _Optional[_Union[LongTextPolicy, str]] = ..., label_values: _Optional[_Iterable[str]] = ..., probabilities_calibrated: _Optional[bool] = ..., calibration_temperature: _Optional[float] = ..., model_card: _Optional[str] = ..., model_version: _Optional[str] = ...) -> None: ...
