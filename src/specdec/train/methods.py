"""The table of drafter trainers, above the trainers it names (each imports features.py, never this)."""

from __future__ import annotations


def drafter_training(name: str, config_path: str | None, preset: str):
    """(configuration, train function) of the drafter method ``name`` (medusa, eagle, eagle3, dflash, dspark):
    its preset, or a JSON file over it; EAGLE's version follows the name."""
    from dataclasses import replace

    from specdec.train import dflash, dspark, eagle, medusa

    module, train = {"medusa": (medusa, medusa.train_medusa), "dflash": (dflash, dflash.train_dflash),
                     "dspark": (dspark, dspark.train_dspark)}.get(
        name, (eagle, eagle.train_eagle))
    config = module.load_config(config_path, preset)
    if module is eagle:
        config = replace(config, version=3 if name == "eagle3" else 1)
    return config, train
