"""Training the models arsparse ships: a resumable GPT trainer and the data sets it knows."""
from .trainer import RECIPES, TrainConfig, TrainResult, export_model, load_checkpoint, recipe_config, train_gpt

__all__ = ["RECIPES", "TrainConfig", "TrainResult", "export_model", "load_checkpoint", "recipe_config", "train_gpt"]
