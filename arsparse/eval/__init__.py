"""Quality evaluation of sparse-attention policies against dense (``arsparse eval``).

- :func:`evaluate` / :class:`EvalConfig`: the whole eval for one model and a list of policies.
- :func:`teacher_forced_metrics`: NLL (bits/token), KL(dense || policy), top-1 agreement.
- :func:`frechet_distance`, :func:`feature_stats`: the Fréchet distance between fitted Gaussians.
- :class:`ImageClassifier`, :func:`load_classifier`: the shipped feature classifiers (fashion, emoji).
- :class:`MobileNetV2`, :func:`load_mobilenet`, :class:`MobileNetFeatures`: ImageNet features.
- :class:`InceptionV3`, :func:`load_inception`, :class:`InceptionFeatures`: the standard FID's features,
  from weights the user gives.
- :func:`add_eval_parser`: the ``eval`` subcommand for the main command line.
"""
from .classifier import CLASSIFIER_FILE, CLASSIFIER_FILES, FashionClassifier, ImageClassifier, load_classifier
from .evaluate import (EvalConfig, HeldOut, build_policies, emoji_heldout, evaluate, fashion_heldout,
                       teacher_forced_metrics, write_report)
from .frechet import feature_stats, frechet_distance, frechet_from_features
from .inception import InceptionFeatures, InceptionV3, find_inception_weights, load_inception
from .mobilenet import MobileNetFeatures, MobileNetV2, find_mobilenet_weights, load_mobilenet


def add_eval_parser(subparsers):
    """Add the ``eval`` subcommand to the main command line (see :mod:`arsparse.eval.cli`)."""
    from .cli import add_eval_parser as add

    return add(subparsers)


__all__ = ["CLASSIFIER_FILE", "CLASSIFIER_FILES", "EvalConfig", "FashionClassifier", "HeldOut", "ImageClassifier",
           "emoji_heldout", "fashion_heldout", "InceptionFeatures", "InceptionV3", "MobileNetFeatures", "MobileNetV2",
           "add_eval_parser", "build_policies", "evaluate", "feature_stats", "find_inception_weights",
           "find_mobilenet_weights", "frechet_distance", "frechet_from_features", "load_classifier", "load_inception",
           "load_mobilenet",
           "teacher_forced_metrics", "write_report"]
