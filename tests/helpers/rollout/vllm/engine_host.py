"""The exact-vLLM tests' engine host: `python -m tests.helpers.rollout.vllm.engine_host`, one
process that imports vLLM once (with its plugins: the environment, exact or plain, is fixed
for the process's life) and runs engine jobs one after another, each starting its engines
fresh and closing them before it answers. Importing vLLM and warming its first engine cost
10-12 s a process on a 2-core EPYC; the tests' engines themselves 2-4 s each.

Protocol: tests/helpers/framed_process.py; a request is (job, spec), the answer the job's
result. Jobs: "engines" (engine_run.run_all) and "sampler" (sampler_run.run).
"""

from __future__ import annotations

from tests.helpers.framed_process import serve


def handle(request: tuple[str, dict]):
    job, spec = request
    if job == "engines":
        from tests.helpers.rollout.vllm.engine_run import run_all

        return run_all(spec)
    if job == "sampler":
        from tests.helpers.rollout.vllm.sampler_run import run

        return run(spec)
    raise ValueError(f"unknown engine job {job!r}: 'engines' or 'sampler'")


if __name__ == "__main__":
    import gc

    import vllm  # noqa: F401  (once, before the first job; its plugins load with it)

    gc.collect()
    gc.freeze()  # out of the engines' full collections (engine_run.free_engines)
    serve(handle)
