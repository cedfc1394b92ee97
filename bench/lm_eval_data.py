"""The local documents and lm-eval task YAMLs of ``bench.lm_eval_compare`` (our own content; no hub
dataset is reachable from the machines this runs on). Three small tasks:

* ``ec_mc`` -- multiple choice, 4 choices (``output_type: multiple_choice``: loglikelihood requests);
* ``ec_gen`` -- short answers after a few-shot description (``generate_until``, exact match);
* ``ec_chat`` -- one-word answers to chat questions (``generate_until``; run with
  ``--apply_chat_template``, through ``local-chat-completions`` on the server).
"""

from __future__ import annotations

import json
from pathlib import Path

# (question, choices, index of the right one)
MC = [
    ("The capital of France is", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("The capital of Japan is", ["Seoul", "Beijing", "Tokyo", "Bangkok"], 2),
    ("The largest planet in the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["0 degrees Celsius", "50 degrees Celsius",
                                           "100 degrees Celsius", "200 degrees Celsius"], 0),
    ("The animal known as the king of the jungle is the", ["mouse", "rabbit", "lion", "frog"], 2),
    ("The colour of a clear daytime sky is", ["green", "blue", "red", "black"], 1),
    ("A week has", ["five days", "six days", "seven days", "ten days"], 2),
    ("The opposite of hot is", ["cold", "loud", "tall", "fast"], 0),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The sun rises in the", ["north", "south", "west", "east"], 3),
    ("A triangle has", ["three sides", "four sides", "five sides", "six sides"], 0),
    ("The chemical symbol for gold is", ["Ag", "Fe", "Au", "Cu"], 2),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "William Shakespeare",
                                            "Jane Austen", "Mark Twain"], 1),
    ("The fastest land animal is the", ["cheetah", "turtle", "snail", "cow"], 0),
    ("The largest ocean on Earth is the", ["Arctic Ocean", "Indian Ocean", "Atlantic Ocean",
                                            "Pacific Ocean"], 3),
    ("People breathe in", ["helium", "oxygen", "neon", "argon"], 1),
    ("A baby cat is called a", ["puppy", "calf", "kitten", "foal"], 2),
    ("The Great Wall is in", ["China", "Brazil", "Canada", "Egypt"], 0),
    ("Ice is the solid form of", ["sand", "air", "water", "salt"], 2),
    ("The planet closest to the sun is", ["Earth", "Mercury", "Saturn", "Neptune"], 1),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The language spoken in Brazil is", ["Spanish", "French", "German", "Portuguese"], 3),
    ("A spider has", ["eight legs", "six legs", "four legs", "two legs"], 0),
    ("The Eiffel Tower is in", ["London", "Paris", "Vienna", "Prague"], 1),
    ("Plants make food from sunlight by", ["digestion", "photosynthesis", "erosion",
                                            "evaporation"], 1),
    ("The currency of the United States is the", ["euro", "yen", "dollar", "rupee"], 2),
    ("The tallest mountain on Earth is", ["Mount Everest", "Mount Fuji", "Mont Blanc",
                                           "Kilimanjaro"], 0),
    ("An apple a day keeps the", ["teacher away", "doctor away", "rain away", "dog away"], 1),
    ("The first month of the year is", ["March", "June", "January", "October"], 2),
    ("Fish live in", ["trees", "deserts", "clouds", "water"], 3),
    ("The hardest natural material is", ["diamond", "wood", "paper", "chalk"], 0),
    ("The number of continents on Earth is", ["three", "five", "seven", "twelve"], 2),
]

GEN_DESCRIPTION = ("Q: What is the plural of dog?\nA: dogs\n\n"
                   "Q: What is the opposite of up?\nA: down\n\n"
                   "Q: What colour is grass?\nA: green\n\n")

# (question, answer)
GEN = [
    ("What is the plural of cat?", "cats"),
    ("What is the opposite of hot?", "cold"),
    ("What colour is snow?", "white"),
    ("What is the opposite of day?", "night"),
    ("What is the capital of France?", "Paris"),
    ("What is the plural of car?", "cars"),
    ("What is the opposite of big?", "small"),
    ("What colour is the sky?", "blue"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the opposite of left?", "right"),
    ("What animal says moo?", "cow"),
    ("What is the plural of book?", "books"),
    ("What is the opposite of open?", "closed"),
    ("What colour is a banana?", "yellow"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the opposite of fast?", "slow"),
    ("What is the plural of tree?", "trees"),
    ("What animal barks?", "dog"),
    ("What is the opposite of happy?", "sad"),
    ("What colour is coal?", "black"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the opposite of wet?", "dry"),
    ("What is the plural of hat?", "hats"),
    ("What is the opposite of old?", "new"),
]

# (user message, answer)
CHAT = [
    ("What is the capital of France? Answer with one word.", "Paris"),
    ("What colour is the sky on a clear day? Answer with one word.", "Blue"),
    ("What is the opposite of cold? Answer with one word.", "Hot"),
    ("Which animal says meow? Answer with one word.", "Cat"),
    ("What is the capital of Japan? Answer with one word.", "Tokyo"),
    ("What do bees make? Answer with one word.", "Honey"),
    ("What colour is grass? Answer with one word.", "Green"),
    ("What is frozen water called? Answer with one word.", "Ice"),
    ("What is the largest planet? Answer with one word.", "Jupiter"),
    ("What is the opposite of up? Answer with one word.", "Down"),
    ("Which animal barks? Answer with one word.", "Dog"),
    ("What is the capital of Italy? Answer with one word.", "Rome"),
    ("What colour is a ripe banana? Answer with one word.", "Yellow"),
    ("What is the opposite of night? Answer with one word.", "Day"),
    ("What gas do people breathe in to live? Answer with one word.", "Oxygen"),
    ("Which star is closest to the Earth? Answer with one word.", "Sun"),
    ("What is the capital of Germany? Answer with one word.", "Berlin"),
    ("What do cows drink? Answer with one word.", "Water"),
    ("What colour is snow? Answer with one word.", "White"),
    ("What is the opposite of slow? Answer with one word.", "Fast"),
]

_MC_YAML = """\
task: ec_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
  - metric: acc_norm
"""

_GEN_YAML = """\
task: ec_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
description: {description}
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0.0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
"""

_CHAT_YAML = """\
task: ec_chat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
filter_list:
  - name: last_word  # "The capital of France is Paris." -> "Paris"
    filter:
      - function: regex
        regex_pattern: "[A-Za-z]+"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


def texts() -> list[str]:
    """Every prompt and continuation text, for the tokenizer parity check."""
    out = [f"Question: {q}\nAnswer: {c}" for q, cs, _ in MC for c in cs]
    out += [GEN_DESCRIPTION + f"Q: {q}\nA: {a}" for q, a in GEN]
    return out


def chat_messages() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q, _ in CHAT]


def write_tasks(root: Path) -> Path:
    """Write the JSONL documents and task YAMLs under ``root``; returns the ``--include_path``."""
    root.mkdir(parents=True, exist_ok=True)
    docs = {
        "ec_mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MC],
        "ec_gen": [{"question": q, "answer": a} for q, a in GEN],
        "ec_chat": [{"question": q, "answer": a} for q, a in CHAT],
    }
    for name, rows in docs.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "ec_mc.yaml").write_text(_MC_YAML.format(data=json.dumps(str(root / "ec_mc.jsonl"))))
    (root / "ec_gen.yaml").write_text(_GEN_YAML.format(data=json.dumps(str(root / "ec_gen.jsonl")),
                                                       description=json.dumps(GEN_DESCRIPTION)))
    (root / "ec_chat.yaml").write_text(_CHAT_YAML.format(data=json.dumps(str(root / "ec_chat.jsonl"))))
    return root
