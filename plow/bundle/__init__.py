"""The compiler-runtime contract (docs/bundle.md): what a bundle directory holds and how it
is read. The emitter (`plow.emit`) writes it; every executor and `plow verify` read only it.

- `plow.bundle.manifest` — `manifest.json` (`Manifest`, its rungs, versions, weights info),
  the certificate files (`CheckpointCertificates`), the bundle digest every certificate
  carries, the file hashes, `read_manifest`, `MalformedBundle`;
- `plow.bundle.files` — the per-rung op table and schedule file (`OpTable`, `ScheduleFile`);
- `plow.bundle.wire` — the plan file's packet records (wire v1, docs/wire.md);
- `plow.bundle.stream` — a packet stream parsed back into tasks (`group_tasks`);
- `plow.bundle.ladder` — the rungs and the runtime's rounding rule;
- `plow.bundle.argmax` — the layout of greedy sampling fused into lm_head (`FUSED_ARGMAX`);
- `plow.bundle.open` — what an executor checks before it runs a bundle (`check_bundle`:
  hashes, certificates bound to the bundle digest), `BundleRefused`.

Nothing here imports the compiler (`plow.tiles`, `plow.schedule`, `plow.memory`, `plow.emit`;
tests/bundle/test_layering.py).
"""
