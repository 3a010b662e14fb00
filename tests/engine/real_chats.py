"""Real chat prompts for the real-model tests: English, code, CJK, emoji, a long system prompt, multi-turn."""

from __future__ import annotations

LONG_SYSTEM = (
    "You are the support assistant of a company that runs a shared GPU inference platform for many "
    "teams. Answer briefly and precisely. Each team has API keys, a monthly token quota, a limit of "
    "requests per minute and a limit of tokens per minute. When a request is refused because of a "
    "limit, explain which limit was reached and when it resets. Never reveal one team's usage to "
    "another team. If you do not know an answer, say so and suggest contacting the operators. "
    "Keep every answer under one hundred words, use plain sentences, and avoid lists unless the "
    "user asks for steps. Prices are in euros. The platform serves open models only."
)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


CHATS: list[list[dict[str, str]]] = [
    _user("What is the capital of France?"),
    _user("Name three primary colors."),
    _user("Explain in two sentences why the sky is blue."),
    _user("What is 17 multiplied by 3?"),
    _user("Give me a short tip for sleeping better."),
    _user("Translate 'good morning' into Spanish."),
    _user("Write a haiku about autumn leaves."),
    _user("Who wrote Romeo and Juliet?"),
    _user("Write a Python function that returns the factorial of n."),
    _user("What does this JavaScript print?\n\nconsole.log([1, 2, 3].map(x => x * 2));"),
    _user("Fix the bug:\n```python\ndef add(a, b):\n    return a - b\n```"),
    _user("Write a SQL query that counts the rows of a table named users."),
    _user("用一句话介绍一下北京。"),
    _user("日本の首都はどこですか？"),
    _user("안녕하세요! 오늘 날씨가 어때요?"),
    _user("What does the emoji 🎉 usually mean?"),
    _user("Reply with three emojis that describe the ocean 🌊"),
    _user("I feel 😴 today. Any advice?"),
    [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "My requests get a 429 error. Why?"},
    ],
    [
        {"role": "system", "content": LONG_SYSTEM},
        {"role": "user", "content": "Can I see how much team B used?"},
    ],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "How are you?"},
    ],
    [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada! How can I help you today?"},
        {"role": "user", "content": "What is my name?"},
    ],
    [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 = 4."},
        {"role": "user", "content": "And if you multiply that by 10?"},
    ],
    [
        {"role": "system", "content": "You answer in French."},
        {"role": "user", "content": "What is your favourite season?"},
        {"role": "assistant", "content": "J'aime beaucoup l'automne."},
        {"role": "user", "content": "Why?"},
    ],
]
