"""Image kernels shared by the Loader's decoders and ``stoker.io``: libjpeg-turbo decoding, crop geometry, resizing.

``_turbojpeg`` binds libjpeg-turbo's TurboJPEG 3 API (from the ``turbojpeg``
wheel) for compiled code; ``_kernels`` holds the compiled decode, crop and
resize kernels. They know nothing of fields, pipelines or the Loader: the
decoders in :mod:`stoker.decoders.arrays` and the functions of :mod:`stoker.io`
call them. Nothing is loaded at import but Numba's cached kernels.
"""
