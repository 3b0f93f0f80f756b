"""Every script that measures (speed, memory, precision, the generated tables in docs/) lives here and
runs as ``python -m benchmarks.<name>``; the library packages (kernels/, model/, data_pipeline/,
pretrain/) hold none, so what training imports never carries measuring code."""
