"""The CLI of serving: `mha-onnx serve` (see mha_onnx.serve)."""

from __future__ import annotations

import click


@click.command("serve")
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=int, default=8000, show_default=True, help="0: a free port.")
@click.option("--name", default=None, help="The model id clients send (default: the folder's "
                                           "name).")
@click.option("--max-batch", type=int, default=16, show_default=True,
              help="Rows decoded together (encoders: inputs embedded together).")
@click.option("--max-length", type=int, default=None,
              help="Positions a row holds, prompt and new tokens (default: the model's "
                   "context, at most 4096).")
@click.option("--max-queue", type=int, default=64, show_default=True,
              help="Requests that may wait for a row; past it, 429.")
@click.option("--prefill-chunk", type=int, default=512, show_default=True,
              help="Prompt positions run between two decode steps while rows stream (0: a "
                   "whole prompt in one run); smaller chunks keep the running streams moving "
                   "while a long prompt joins. With no row streaming, a run takes 512 if "
                   "that is more.")
@click.option("--mixed-steps/--no-mixed-steps", default=True, show_default=True,
              help="A joining prompt's chunk and the running rows' step in one run, where "
                   "the file allows it (the weights read once for both).")
@click.option("--request-timeout", type=float, default=None,
              help="Seconds a request may take (504 past it; default: none).")
@click.option("--grace", type=float, default=30.0, show_default=True,
              help="Seconds a shutdown (SIGTERM) waits for running requests.")
@click.option("--batch-window", type=float, default=0.005, show_default=True,
              help="Encoders: seconds to wait for more inputs to batch.")
@click.option("--tokenizer", "tokenizer_dir", default=None,
              help="A folder with tokenizer.json (default: the model's, or the HF folder it "
                   "was exported from).")
@click.option("--threads", type=int, default=None, help="Intra-op threads for ORT.")
@click.option("--prompt-as-written", is_flag=True,
              help="Every run of a quantized model through the file as written (as "
                   "generate's option).")
@click.option("--replicas", type=int, default=0, show_default=True,
              help="N >= 1: N replicas behind Ray Serve's HTTP proxy on a local Ray cluster "
                   "(pip install 'mha-onnx[ray]'); 0: this process alone.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["critical", "error", "warning", "info", "debug"]))
def serve_command(model, host, port, name, max_batch, max_length, max_queue, prefill_chunk,
                  mixed_steps, request_timeout,
                  grace, batch_window, tokenizer_dir, threads, prompt_as_written, replicas,
                  log_level):
    """Serve a decoder (OpenAI's /v1/completions and /v1/chat/completions, continuous
    batching) or an encoder (/v1/embeddings, dynamic batching) over HTTP, with /health,
    /ready and /metrics."""
    from mha_onnx.serve.config import EngineConfig
    from mha_onnx.serve.server import run_server
    from mha_onnx.serve.service import ServeConfig, Service

    config = ServeConfig(EngineConfig(max_batch=max_batch, max_length=max_length,
                                      max_queue=max_queue, timeout=request_timeout,
                                      threads=threads, prefill_chunk=prefill_chunk,
                                      mixed_steps=mixed_steps,
                                      float_prompt=False if prompt_as_written else None),
                         name=name, grace=grace, window=batch_window, tokenizer=tokenizer_dir)
    if replicas:
        from mha_onnx.serve.ray_serve import run_replicas
        from mha_onnx.serve.service import model_file

        path = model_file(model)  # (refused here, before Ray starts, when it is not there)
        raise SystemExit(run_replicas(str(path), config, host, port, replicas, on_ready=lambda
                                      bound: click.echo(f"serving {replicas} replica(s) of "
                                                        f"{path} on http://{host}:{bound}",
                                                        err=True)))
    service = Service(model, config)
    for note in service.notes:
        click.echo(f"note: {note}", err=True)

    def ready(bound: int) -> None:
        click.echo(f"serving {service.name} ({service.task}) on http://{host}:{bound}", err=True)

    raise SystemExit(run_server(service, host, port, log_level, on_ready=ready))
