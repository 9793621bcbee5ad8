"""What the tests share besides fixtures (those live in the conftests), one module per subject:
``images`` (files made for a test), ``vectors`` (synthetic embeddings and index entries), ``waiting``
(polling for a condition), ``served`` (writable copies of the demo gallery, index and model), ``servers``
(``dmlsearch serve`` in a real uvicorn process), ``apps`` (the app in process), ``milvus_server`` (the real
Milvus server's lifecycle), ``ray_cluster`` (a local Ray cluster), ``train_config`` (a tiny training config)
and ``decoding`` (a decoder that runs in the test). The helpers bench/ shares with the tests (images, a small
exported model, server starts, the Ray cluster, process-group checks) live in ``bench/lib``, imported from
there."""
