"""Reward functions the trainer tests load by dotted path (as a user's own would be)."""


def answer_token_fraction(response: str, answer: str) -> float:
    """Fraction of the response's words equal to `answer` (varied rewards for a random model)."""
    words = response.split()
    return words.count(answer) / len(words) if words else 0.0


def always_raises(response: str, answer: str) -> float:
    """A broken user reward: must score 0 and be counted, never end the run."""
    raise RuntimeError("reward exploded")


def first_word_even(response: str, answer: str) -> float:
    """1 when the response's first word is w<even>: about half the samples of a random model,
    so most groups have mixed rewards and dynamic sampling keeps them."""
    words = response.split()
    return 1.0 if words and words[0][1:].isdigit() and int(words[0][1:]) % 2 == 0 else 0.0
