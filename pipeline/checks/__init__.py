"""Every refusal of a `kvtc` command's input, each rule written once, in the module of the earliest stage that can
decide it. A new check goes where the facts it needs first exist:

| stage | module | decides from | runs |
|---|---|---|---|
| a word alone | `words.py` | option values, URIs (`--store`, `--registry`), file kinds (key and quality files) | the command line, before torch, transformers or Ray load |
| the environment | `environment.py` | `RAY_*` and `KVTC_*` variables, parsed by the function their reader calls (`kvtc.artifacts.env_values`) | with the words |
| a header | `header.py` | a model's GGUF header or config.json, an artifact's manifest (sinks, window, context) | before the model loads |
| the machine | `machine.py` | this machine's CPUs and GPUs (`Machine.of`, which also says whether the job joins a cluster); a joined cluster's alive nodes (`check_cluster`) | before Ray starts; right after joining, before any actor |

What only the loaded model config tells (its layer schema, MLA widths) and what only memory measured now tells
stays with the job's plan stage (`kvtc.pipeline.job.calibrate.check_settings`), which calls the same rules
where they exist (the ratio rule is `kvtc.artifacts.blocks.check_payable`). A value is parsed once, by the parser
that later reads it, so a check never accepts what its reader refuses or reads otherwise. Untrusted files are
opened one way (`kvtc.artifacts.safe_io.open_regular`; tests/integrity lists the readers). Nothing here imports
torch, transformers or Ray.
"""
