"""`bench rl`'s task: prompts and the exact verifier that scores them."""

from baige_ray.bench.rl import arithmetic_prompts, arithmetic_reward


def test_the_arithmetic_task_covers_every_sum_once_and_scores_exactly():
    prompts = arithmetic_prompts()
    assert len(prompts) == len(set(prompts)) == 100 and prompts == arithmetic_prompts()
    assert arithmetic_reward("3+4=", " 7") == 1.0 and arithmetic_reward("9+9=", "18 and more") == 1.0
    assert arithmetic_reward("3+4=", "12ab") == 0.25  # digits, not the sum: half credit for the share of digits
    assert arithmetic_reward("3+4=", "abcd") == 0.0 and arithmetic_reward("3+4=", "") == 0.0
