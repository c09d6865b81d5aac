"""Errors survive pickling (they cross process boundaries in the writer) with their notes."""

from __future__ import annotations

import pickle

from stoker.errors import DatasetFormatError, LoaderError, SampleError


def test_errors_pickle_with_their_fields_and_notes() -> None:
    errors = [DatasetFormatError("/x.stoker", "truncated"), SampleError(7, "image", "bad"), LoaderError("y", "IntDecoder()", 3, "boom")]
    for err in errors:
        err.add_note("Traceback (most recent call last): ...")
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert back.__notes__ == err.__notes__
    assert pickle.loads(pickle.dumps(errors[1])).index == 7
