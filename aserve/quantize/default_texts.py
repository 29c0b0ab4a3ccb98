"""The built-in calibration set of `aserve quantize` (used when no --calib-token-ids / --calib-dataset is
given): chat questions, rendered through the model's chat template when it has one, and short passages of
prose, code and other languages, rendered as plain text. Small on purpose: it runs offline in minutes on
a CPU; pass a larger set for production checkpoints."""

CHAT_QUESTIONS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis simply.",
    "How do I reverse a list in Python?", "Name three primary colors.", "What causes rain?",
    "Give me a tip for better sleep.", "Who wrote Romeo and Juliet?", "What is 12 times 7?",
    "Describe a cat in one sentence.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "What is a prime number?", "Suggest a name for a bakery.", "How does a bicycle work?",
    "What is the boiling point of water?", "Tell me a fun fact about octopuses.", "What is gravity?",
    "How do vaccines work?", "Write a short greeting for a birthday card.", "What is machine learning?",
    "List two uses of copper.", "What is the largest planet?", "How do I make tea?",
    "Explain what a verb is.", "Why do leaves change color in autumn?", "What is an atom?",
    "Give me a synonym for happy.", "How many continents are there?", "What does a compiler do?",
    "Describe the moon.", "What is democracy?",
)

PASSAGES = (
    ("The river wound slowly through the valley, its banks lined with willows whose branches brushed the "
    "water. In spring the meadows on either side filled with yellow flowers, and farmers brought their "
    "cattle down from the hills to graze."),
    ("Photosynthesis takes place in the chloroplasts of plant cells. Light energy splits water molecules, "
    "releasing oxygen, while the energy captured is stored in sugars built from carbon dioxide."),
    ("def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])"),
    ("SELECT customer_id, SUM(amount) AS total\nFROM orders\nWHERE created_at >= '2024-01-01'\n"
    "GROUP BY customer_id\nORDER BY total DESC\nLIMIT 10;"),
    ("The central bank left interest rates unchanged on Thursday, citing slowing inflation and a labour "
    "market that remains tight. Markets had expected the decision, and bond yields barely moved."),
    ("To make a simple bread, mix 500 grams of flour, 10 grams of salt, 7 grams of yeast and 350 millilitres "
    "of warm water. Knead for ten minutes, let it rise for an hour, shape it and bake at 220 degrees."),
    ("La ville de Lyon est connue pour sa gastronomie et ses traboules, des passages qui traversent les "
    "immeubles du Vieux Lyon. Chaque année, la Fête des Lumières attire des millions de visiteurs."),
    ("Der Zug nach Berlin hatte zwanzig Minuten Verspätung, weil ein Signal gestört war. Die Fahrgäste "
    "warteten geduldig auf dem Bahnsteig und tranken Kaffee."),
    ("El sol se ponía detrás de las montañas mientras los pescadores volvían al puerto con sus redes llenas. "
    "En la plaza, los niños jugaban al fútbol hasta que oscureció."),
    "東京は日本の首都であり、世界で最も人口の多い都市圏の一つです。電車は時間通りに走ります。",
    ("An operating system manages memory, schedules processes and provides a file system. The kernel runs "
    "in a privileged mode, while applications run in user space and ask it for services through system calls."),
    ("for (let i = 0; i < items.length; i++) {\n  if (items[i].price > 100) {\n    console.log(items[i].name);"
    "\n  }\n}"),
    ("Dear Ms. Patel,\nThank you for your letter of 3 March. I am pleased to confirm your booking for two "
    "nights in a double room with a sea view. Breakfast is served from seven until ten.\nKind regards,\nTom"),
    ("The mitochondrion produces most of the cell's supply of adenosine triphosphate, which is used as a "
    "source of chemical energy. Cells with high energy needs, such as muscle cells, contain many of them."),
    ("In 1969 the Apollo 11 mission landed two astronauts on the Moon. Neil Armstrong stepped onto the "
    "surface first, followed by Buzz Aldrin, while Michael Collins orbited above in the command module."),
    "Q: What is 15% of 80?\nA: 15% of 80 is 0.15 times 80, which is 12.\nQ: And 20% of 45?\nA: 9.",
    ("The recipe calls for three eggs, but we only had two, so we added a spoonful of yoghurt instead. "
    "The cake rose well and nobody noticed the difference."),
    ("git checkout -b feature/login\ngit add src/auth.py tests/test_auth.py\n"
    "git commit -m \"Add login with session cookies\"\ngit push origin feature/login"),
    ("Rain had fallen all night, and by morning the streets were shining. The old man opened his shop, set "
    "out the newspapers and waited for the first customers of the day."),
    ("A prime number has exactly two divisors, one and itself. The first few primes are 2, 3, 5, 7, 11 and 13; "
    "there are infinitely many of them, as Euclid proved more than two thousand years ago."),
    "{\"name\": \"Ada\", \"languages\": [\"Python\", \"C\"], \"active\": true, \"projects\": 4}",
    ("Il treno per Firenze parte alle nove. Se arriviamo presto, possiamo prendere un caffè in stazione e "
    "comprare un giornale."),
    ("Climate is the average weather over many years, while weather describes conditions from day to day. "
    "A single cold winter does not contradict a warming trend measured over decades."),
    ("The meeting has been moved to Thursday at 3 pm. Please bring the quarterly figures and the draft of "
    "the marketing plan, and let me know if you cannot attend."),
)
