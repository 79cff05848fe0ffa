"""`warply export SPEC.yaml`: the spec's Kubernetes manifests (plain, or NVIDIA Dynamo's)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from warply.common.argtypes import output_file
from warply.common.files import write_private


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `export` verb."""
    e = sub.add_parser(
        "export",
        help="write a spec's Kubernetes manifests (Deployments/Services or a Dynamo graph)",
        description="Write the manifests for SPEC (the YAML `warply up` reads): plain "
        "Deployments, Services, a ConfigMap and a Secret (--target kubernetes), or an NVIDIA "
        "Dynamo DynamoGraphDeployment with the same Services, ConfigMap and Secret (--target "
        "dynamo). Exit codes: 0 written, 2 a bad spec or option.",
    )
    e.add_argument("spec", type=Path, help="spec file (YAML)")
    e.add_argument("--target", choices=("kubernetes", "dynamo"), default="kubernetes",
                   help="manifest flavour (default: kubernetes)")  # fmt: skip
    e.add_argument("--name", default="warply", help="prefix of every object (default: warply)")
    e.add_argument("--image", help="engine + Warply image (default: warply:VERSION-BACKEND)")
    e.add_argument("--namespace", help="namespace of every object (default: none set)")
    e.add_argument("--model-pvc", help="claim holding a local model folder (default: NAME-models)")
    e.add_argument(
        "-o", "--output", type=output_file, help="write here instead of standard output"
    )
    e.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from warply.export import ExportError, export_yaml
    from warply.spec.deployment import SpecError, load_spec

    try:
        text = export_yaml(load_spec(args.spec), args.target, name=args.name, image=args.image,
                           namespace=args.namespace, model_pvc=args.model_pvc)  # fmt: skip
    except (SpecError, ExportError) as exc:
        print(f"warply export: {exc}", file=sys.stderr)
        return 2
    if args.output is None:
        sys.stdout.write(text)
    else:
        write_private(args.output, text)  # its Secret holds the router's tokens
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
