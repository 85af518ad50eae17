"""Task set of the bundled "python coding" environment: write one Python function, scored by hidden tests.

Each `CodingTask` describes a single function the policy must write: `prompt` and `signature` are what it
reads; `reference` is a correct standard-library implementation that is never shown to the policy; `cases`
are the hidden test inputs (each a tuple of positional arguments). The environment computes the expected
outputs by running `reference` on every case, so every argument and every return value must survive a
JSON round trip unchanged (lists, not tuples or sets; dicts with str keys; finite floats), and every
reference must be deterministic and fast. `compare` says how a result is matched against the expectation:
"exact" (JSON-equal), "float" (numbers within 1e-6 relative) or "unordered" (a list whose order does not
matter). The tasks are original, written for this environment, and spread roughly evenly over easy,
medium and harder. `check_tasks` verifies all of this.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from typing import Any

COMPARE_MODES = ("exact", "float", "unordered")


@dataclass(frozen=True)
class CodingTask:
    """One function-writing task; see the module docstring for how each field is used."""

    name: str
    function: str
    signature: str
    prompt: str
    reference: str
    cases: tuple[tuple, ...]
    compare: str = "exact"


# --------------------------------------------------------------------------------------------------
# Easy
# --------------------------------------------------------------------------------------------------

_EASY = (
    CodingTask(
        name="run_length_encode",
        function="run_length_encode",
        signature="def run_length_encode(text: str) -> list[list]:",
        prompt=(
            "Write `run_length_encode(text)` that splits a string into maximal runs of one repeated "
            "character and returns a list of `[character, count]` pairs in order. Characters are compared "
            "exactly (case-sensitive; every Unicode code point is one character). An empty string gives "
            '`[]`. Example: `run_length_encode("aaBBBa")` returns `[["a", 2], ["B", 3], ["a", 1]]`.'
        ),
        reference="""
def run_length_encode(text: str) -> list[list]:
    runs = []
    for ch in text:
        if runs and runs[-1][0] == ch:
            runs[-1][1] += 1
        else:
            runs.append([ch, 1])
    return runs
""",
        cases=(
            ("",),
            ("a",),
            ("aaBBBa",),
            ("abc",),
            ("zzzzzzzzzz",),
            ("  \n\n",),
            ("ééèè",),
            ("aAaA",),
            ("x" * 50 + "y" * 3 + "x",),
        ),
    ),
    CodingTask(
        name="is_alnum_palindrome",
        function="is_alnum_palindrome",
        signature="def is_alnum_palindrome(text: str) -> bool:",
        prompt=(
            "Write `is_alnum_palindrome(text)` that returns True if `text` reads the same forwards and "
            "backwards after dropping every character for which `str.isalnum()` is false and lowercasing the "
            "rest with `str.lower()`, and False otherwise. A string with no alphanumeric characters "
            '(including the empty string) counts as a palindrome. Examples: `"Never odd, or even!"` gives '
            'True; `"ab1"` gives False.'
        ),
        reference="""
def is_alnum_palindrome(text: str) -> bool:
    kept = [ch.lower() for ch in text if ch.isalnum()]
    return kept == kept[::-1]
""",
        cases=(
            ("",),
            ("!! ?",),
            ("a",),
            ("Never odd, or even!",),
            ("ab1",),
            ("No 'x' in Nixon",),
            ("Ésope reste ici et se repose",),
            ("été",),
            ("12321",),
            ("123 21a",),
            ("Aa",),
        ),
    ),
    CodingTask(
        name="second_largest_distinct",
        function="second_largest_distinct",
        signature="def second_largest_distinct(nums: list[int]) -> int | None:",
        prompt=(
            "Write `second_largest_distinct(nums)` that returns the second largest distinct value in a list "
            "of integers, or None when the list has fewer than two distinct values. Repeated copies of the "
            "maximum do not count as the second largest. Examples: `[5, 1, 5, 3]` gives 3; `[7, 7]` gives "
            "None."
        ),
        reference="""
def second_largest_distinct(nums: list[int]) -> int | None:
    values = sorted(set(nums))
    return values[-2] if len(values) >= 2 else None
""",
        cases=(
            ([],),
            ([4],),
            ([7, 7],),
            ([5, 1, 5, 3],),
            ([-1, -2, -3],),
            ([10**12, -(10**12)],),
            ([2, 2, 1, 1, 3, 3],),
            ([0, 0, 0, -1],),
        ),
    ),
    CodingTask(
        name="flatten_nested",
        function="flatten_nested",
        signature="def flatten_nested(items: list) -> list:",
        prompt=(
            "Write `flatten_nested(items)` that takes a list whose elements are either lists (nested to any "
            "depth) or other values, and returns a flat list of all the non-list values in left-to-right "
            "order. Values that are not lists (numbers, strings, None, dicts) are kept as they are, and "
            'empty lists contribute nothing. Example: `[1, [2, [3, []]], "a"]` gives `[1, 2, 3, "a"]`.'
        ),
        reference="""
def flatten_nested(items: list) -> list:
    flat = []
    for item in items:
        if isinstance(item, list):
            flat.extend(flatten_nested(item))
        else:
            flat.append(item)
    return flat
""",
        cases=(
            ([],),
            ([[], [[]]],),
            ([1],),
            ([1, [2, [3, []]], "a"],),
            ([[[[[["deep"]]]]], None],),
            ([{"k": [1, 2]}, [True, [False]]],),
            (["ab", ["cd", ["ef"]], "gh"],),
            ([[1, 2], [3, [4, [5, [6, [7]]]]], 8],),
        ),
    ),
    CodingTask(
        name="chunk_list",
        function="chunk_list",
        signature="def chunk_list(items: list, size: int) -> list[list]:",
        prompt=(
            "Write `chunk_list(items, size)` that splits `items` into consecutive chunks of `size` elements "
            "(`size` >= 1), keeping the original order; the last chunk holds whatever remains and may be "
            "shorter. An empty list gives `[]`. Example: `chunk_list([1, 2, 3, 4, 5], 2)` gives `[[1, 2], "
            "[3, 4], [5]]`."
        ),
        reference="""
def chunk_list(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]
""",
        cases=(
            ([], 3),
            ([1], 1),
            ([1, 2, 3, 4, 5], 2),
            ([1, 2, 3], 3),
            ([1, 2, 3], 10),
            (["a", "b", "c", "d"], 1),
            (list(range(20)), 6),
        ),
    ),
    CodingTask(
        name="word_frequencies",
        function="word_frequencies",
        signature="def word_frequencies(text: str) -> dict[str, int]:",
        prompt=(
            "Write `word_frequencies(text)` that counts words. A word is a maximal run of characters for "
            "which `str.isalpha()` is true; every other character (digits, underscores, apostrophes, spaces, "
            "punctuation) separates words. Return a dict mapping each word, lowercased with `str.lower()`, "
            'to its number of occurrences; text without words gives `{}`. Example: `"It\'s it, IT!"` gives '
            '`{"it": 3, "s": 1}`.'
        ),
        reference="""
def word_frequencies(text: str) -> dict[str, int]:
    counts = {}
    word = []
    for ch in text + " ":
        if ch.isalpha():
            word.append(ch)
        elif word:
            key = "".join(word).lower()
            counts[key] = counts.get(key, 0) + 1
            word = []
    return counts
""",
        cases=(
            ("",),
            ("123 !!",),
            ("It's it, IT!",),
            ("hello",),
            ("one two  two\tthree three three",),
            ("Café café CAFÉ",),
            ("a-b_c d4e",),
            ("ÄÖü äöÜ",),
            ("the end" * 40,),
        ),
    ),
    CodingTask(
        name="digital_root",
        function="digital_root",
        signature="def digital_root(n: int) -> int:",
        prompt=(
            "Write `digital_root(n)` for a non-negative integer `n`: repeatedly replace the number by the "
            "sum of its decimal digits until a single digit remains, and return that digit. `0` gives 0. "
            "Example: `9875` gives 2 (9+8+7+5 = 29, 2+9 = 11, 1+1 = 2)."
        ),
        reference="""
def digital_root(n: int) -> int:
    while n >= 10:
        n = sum(int(d) for d in str(n))
    return n
""",
        cases=((0,), (5,), (9,), (10,), (9875,), (999999999999,), (10**18 + 1,), (123456789,)),
    ),
    CodingTask(
        name="caesar_shift",
        function="caesar_shift",
        signature="def caesar_shift(text: str, shift: int) -> str:",
        prompt=(
            "Write `caesar_shift(text, shift)` that moves every ASCII letter `shift` places forward in the "
            "alphabet, wrapping around (`'z'` shifted by 1 is `'a'`) and keeping its case; `shift` may be "
            "negative (move backward) or larger than 26. Every other character, including digits, "
            "punctuation, spaces and non-ASCII letters such as `'é'`, is left unchanged. Example: "
            '`caesar_shift("Hello, World!", 3)` gives `"Khoor, Zruog!"`.'
        ),
        reference="""
def caesar_shift(text: str, shift: int) -> str:
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - ord("a") + shift) % 26 + ord("a")))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - ord("A") + shift) % 26 + ord("A")))
        else:
            out.append(ch)
    return "".join(out)
""",
        cases=(
            ("", 5),
            ("abc", 0),
            ("Hello, World!", 3),
            ("xyz", 1),
            ("ABC", -1),
            ("Zebra", 52),
            ("Zebra", -27),
            ("naïve café", 13),
            ("123 ok", 1000),
        ),
    ),
    CodingTask(
        name="merge_sorted_lists",
        function="merge_sorted_lists",
        signature="def merge_sorted_lists(a: list[int], b: list[int]) -> list[int]:",
        prompt=(
            "Write `merge_sorted_lists(a, b)` that takes two lists of integers, each already sorted in "
            "non-decreasing order, and returns a single list holding every element of both (duplicates kept) "
            "in non-decreasing order. Either or both lists may be empty. Example: `([1, 4, 4], [2, 4])` "
            "gives `[1, 2, 4, 4, 4]`."
        ),
        reference="""
def merge_sorted_lists(a: list[int], b: list[int]) -> list[int]:
    merged = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            merged.append(a[i])
            i += 1
        else:
            merged.append(b[j])
            j += 1
    return merged + a[i:] + b[j:]
""",
        cases=(
            ([], []),
            ([1], []),
            ([], [2]),
            ([1, 3, 5], [2, 4, 6]),
            ([1, 1, 2], [1, 2, 2]),
            ([-5, 0], [-10, 10]),
            (list(range(0, 100, 2)), list(range(1, 100, 3))),
        ),
    ),
    CodingTask(
        name="moving_average",
        function="moving_average",
        signature="def moving_average(values: list[float], window: int) -> list[float]:",
        prompt=(
            "Write `moving_average(values, window)` that returns the mean of every block of `window` "
            "consecutive values (`window` >= 1), from the block starting at index 0 onward, so the result "
            "has `len(values) - window + 1` entries. If `window` is larger than `len(values)`, return `[]`. "
            "Example: `moving_average([1, 2, 3, 4], 2)` gives `[1.5, 2.5, 3.5]`."
        ),
        reference="""
def moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[i : i + window]) / window for i in range(len(values) - window + 1)]
""",
        cases=(
            ([], 1),
            ([1, 2, 3], 5),
            ([4.5], 1),
            ([1, 2, 3, 4], 2),
            ([1, 2, 3, 4], 4),
            ([-1.5, 2.25, 0.0, 10.0, -7.75], 3),
            ([1e9, 1e9 + 1, 1e9 + 2], 2),
            ([0.1] * 12, 5),
        ),
        compare="float",
    ),
    CodingTask(
        name="rotate_list",
        function="rotate_list",
        signature="def rotate_list(items: list, k: int) -> list:",
        prompt=(
            "Write `rotate_list(items, k)` that returns a new list with `items` rotated right by `k` "
            "positions: the last `k` elements move to the front, in order. `k` may be negative (rotate left "
            "by `-k`) or larger than the length; an empty list gives `[]`. Example: `rotate_list([1, 2, 3, "
            "4, 5], 2)` gives `[4, 5, 1, 2, 3]`."
        ),
        reference="""
def rotate_list(items: list, k: int) -> list:
    if not items:
        return []
    k %= len(items)
    return items[len(items) - k :] + items[: len(items) - k]
""",
        cases=(
            ([], 3),
            ([1], 7),
            ([1, 2, 3, 4, 5], 2),
            ([1, 2, 3, 4, 5], 0),
            ([1, 2, 3, 4, 5], -1),
            ([1, 2, 3, 4, 5], 12),
            (["a", "b", "c"], -10),
            ([1, 2, 3, 4], 4),
        ),
    ),
    CodingTask(
        name="hamming_distance",
        function="hamming_distance",
        signature="def hamming_distance(a: int, b: int) -> int:",
        prompt=(
            "Write `hamming_distance(a, b)` that returns the number of bit positions at which the binary "
            "representations of two non-negative integers differ (the shorter one padded with leading "
            "zeros). Example: `hamming_distance(1, 4)` gives 2 (001 vs 100)."
        ),
        reference="""
def hamming_distance(a: int, b: int) -> int:
    return bin(a ^ b).count("1")
""",
        cases=(
            (0, 0),
            (1, 4),
            (7, 0),
            (2**40, 0),
            (2**63 - 1, 2**62),
            (12345, 54321),
            (255, 255),
            (2**100, 2**100 - 1),
        ),
    ),
    CodingTask(
        name="to_roman",
        function="to_roman",
        signature="def to_roman(n: int) -> str:",
        prompt=(
            "Write `to_roman(n)` that converts an integer 1 <= n <= 3999 to a Roman numeral written with the "
            "uppercase symbols I, V, X, L, C, D, M, using the subtractive pairs IV, IX, XL, XC, CD and CM "
            'and never four identical symbols in a row. Examples: 4 gives `"IV"`, 1994 gives `"MCMXCIV"`.'
        ),
        reference="""
def to_roman(n: int) -> str:
    table = [
        (1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
        (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"),
    ]
    out = []
    for value, symbol in table:
        count, n = divmod(n, value)
        out.append(symbol * count)
    return "".join(out)
""",
        cases=((1,), (4,), (9,), (14,), (40,), (90,), (400,), (1994,), (2024,), (3888,), (3999,)),
    ),
    CodingTask(
        name="dedupe_preserve_order",
        function="dedupe_preserve_order",
        signature="def dedupe_preserve_order(items: list) -> list:",
        prompt=(
            "Write `dedupe_preserve_order(items)` that returns `items` without repeated elements, keeping "
            "the first occurrence of each element and the original relative order. Elements are integers or "
            'strings, and the integer 1 and the string `"1"` are different elements. Example: `[3, "a", 3, '
            '1, "a"]` gives `[3, "a", 1]`.'
        ),
        reference="""
def dedupe_preserve_order(items: list) -> list:
    seen = set()
    out = []
    for item in items:
        key = (type(item).__name__, item)
        if key not in seen:
            seen.add(key)
            out.append(item)
    return out
""",
        cases=(
            ([],),
            ([1],),
            ([3, "a", 3, 1, "a"],),
            ([1, "1", 1, "1"],),
            ([5, 5, 5, 5],),
            (["b", "a", "b", "c", "a"],),
            ([-1, 0, -1, 2, 0, 3],),
            ([i % 7 for i in range(50)],),
        ),
    ),
    CodingTask(
        name="capitalize_words",
        function="capitalize_words",
        signature="def capitalize_words(text: str) -> str:",
        prompt=(
            "Write `capitalize_words(text)`. Words are the pieces of `text` between space characters `' '` "
            "(only the plain space separates words; tabs and punctuation belong to words). Uppercase the "
            "first character of each word with `str.upper()` and lowercase the rest of it with "
            "`str.lower()`, keeping every space exactly where it was, including leading, trailing and "
            'repeated spaces. Example: `"  hELLO   wORLD "` gives `"  Hello   World "`.'
        ),
        reference="""
def capitalize_words(text: str) -> str:
    return " ".join(word[:1].upper() + word[1:].lower() for word in text.split(" "))
""",
        cases=(
            ("",),
            ("   ",),
            ("a",),
            ("  hELLO   wORLD ",),
            ("élan vital",),
            ("123abc DEF",),
            ("o'neil mcDONALD",),
            ("tab\tSEPARATED words",),
        ),
    ),
    CodingTask(
        name="pascal_row",
        function="pascal_row",
        signature="def pascal_row(n: int) -> list[int]:",
        prompt=(
            "Write `pascal_row(n)` that returns row `n` (counting from 0) of Pascal's triangle, for n >= 0: "
            "the binomial coefficients C(n, 0) through C(n, n). Row 0 is `[1]` and row 4 is `[1, 4, 6, 4, "
            "1]`."
        ),
        reference="""
def pascal_row(n: int) -> list[int]:
    row = [1]
    for _ in range(n):
        row = [1] + [row[i] + row[i + 1] for i in range(len(row) - 1)] + [1]
    return row
""",
        cases=((0,), (1,), (2,), (4,), (10,), (30,), (60,)),
    ),
    CodingTask(
        name="count_primes_below",
        function="count_primes_below",
        signature="def count_primes_below(n: int) -> int:",
        prompt=(
            "Write `count_primes_below(n)` that returns how many prime numbers are strictly less than the "
            "integer `n`. For n <= 2 (including zero and negative n) the answer is 0. Example: "
            "`count_primes_below(10)` gives 4 (2, 3, 5, 7). `n` can be as large as 200000, so be efficient."
        ),
        reference="""
def count_primes_below(n: int) -> int:
    if n <= 2:
        return 0
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    for p in range(2, int(n**0.5) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytearray(len(range(p * p, n, p)))
    return sum(sieve)
""",
        cases=((-5,), (0,), (1,), (2,), (3,), (10,), (100,), (7919,), (7920,), (200000,)),
    ),
)

# --------------------------------------------------------------------------------------------------
# Medium
# --------------------------------------------------------------------------------------------------

_MEDIUM = (
    CodingTask(
        name="parse_csv_line",
        function="parse_csv_line",
        signature="def parse_csv_line(line: str) -> list[str]:",
        prompt=(
            "Write `parse_csv_line(line)` that splits one line of comma-separated values into its fields. A "
            "field that begins with a double quote is quoted: it extends to the matching closing quote, may "
            'contain commas, and inside it a doubled quote `""` stands for one literal `"`; the closing '
            "quote is always followed by a comma or the end of the line. Unquoted fields are taken "
            'literally, with no whitespace stripping, and contain no quotes. An empty line gives `[""]` and '
            "a trailing comma gives a final empty field; the line is always well-formed. Example: "
            '`a,"b,c",,"say ""hi"""` gives `["a", "b,c", "", "say \\"hi\\""]`.'
        ),
        reference="""
def parse_csv_line(line: str) -> list[str]:
    fields = []
    i, n = 0, len(line)
    while True:
        if i < n and line[i] == '"':
            i += 1
            buf = []
            while True:
                if line[i] == '"':
                    if i + 1 < n and line[i + 1] == '"':
                        buf.append('"')
                        i += 2
                    else:
                        i += 1
                        break
                else:
                    buf.append(line[i])
                    i += 1
            fields.append("".join(buf))
        else:
            j = line.find(",", i)
            if j == -1:
                j = n
            fields.append(line[i:j])
            i = j
        if i >= n:
            return fields
        i += 1
""",
        cases=(
            ("",),
            ("a",),
            (",",),
            ("a,b,c",),
            ('a,"b,c",,"say ""hi"""',),
            ('""',),
            ('"",""',),
            (" x , y ",),
            ('"line, with, commas",42,',),
            ('"ünï,cödé",ok',),
            ('""""',),
        ),
    ),
    CodingTask(
        name="balanced_brackets",
        function="balanced_brackets",
        signature="def balanced_brackets(text: str) -> bool:",
        prompt=(
            "Write `balanced_brackets(text)` that returns True if the brackets `()`, `[]` and `{}` in `text` "
            "are balanced and properly nested, and False otherwise; all other characters are ignored. A text "
            'without brackets (including the empty string) is balanced. Examples: `"a(b[c]{d})"` gives True, '
            '`"([)]"` gives False, `"(("` gives False.'
        ),
        reference="""
def balanced_brackets(text: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack
""",
        cases=(
            ("",),
            ("no brackets",),
            ("a(b[c]{d})",),
            ("([)]",),
            ("((",),
            ("))((",),
            ("}",),
            ("{[()()]}[]",),
            ("(" * 200 + ")" * 200,),
            ("(" * 200 + ")" * 199 + "]",),
        ),
    ),
    CodingTask(
        name="merge_intervals",
        function="merge_intervals",
        signature="def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:",
        prompt=(
            "Write `merge_intervals(intervals)`. Each interval is `[start, end]` with start <= end and "
            "includes both endpoints. Merge every group of intervals that overlap or touch (`[1, 2]` and "
            "`[2, 5]` merge into `[1, 5]`; `[1, 2]` and `[3, 4]` stay apart) and return the merged intervals "
            "sorted by start. The input may be unsorted; `[]` gives `[]`. Example: `[[8, 10], [1, 3], [2, "
            "6]]` gives `[[1, 6], [8, 10]]`."
        ),
        reference="""
def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
""",
        cases=(
            ([],),
            ([[5, 5]],),
            ([[8, 10], [1, 3], [2, 6]],),
            ([[1, 2], [2, 5]],),
            ([[1, 2], [3, 4]],),
            ([[1, 10], [2, 3], [4, 5]],),
            ([[-5, -1], [-3, 0], [10, 20], [0, 0]],),
            ([[i, i + 1] for i in range(0, 40, 3)],),
        ),
    ),
    CodingTask(
        name="spiral_order",
        function="spiral_order",
        signature="def spiral_order(matrix: list[list[int]]) -> list[int]:",
        prompt=(
            "Write `spiral_order(matrix)` that returns the elements of a rectangular matrix (a list of "
            "equal-length rows) in clockwise spiral order: start at the top-left corner, go right along the "
            "top row, down the right column, left along the bottom row, up the left column, then continue "
            "inward. `[]` or `[[]]` gives `[]`. Example: `[[1, 2, 3], [4, 5, 6]]` gives `[1, 2, 3, 6, 5, 4]`."
        ),
        reference="""
def spiral_order(matrix: list[list[int]]) -> list[int]:
    result = []
    if not matrix or not matrix[0]:
        return result
    top, bottom, left, right = 0, len(matrix) - 1, 0, len(matrix[0]) - 1
    while top <= bottom and left <= right:
        for c in range(left, right + 1):
            result.append(matrix[top][c])
        for r in range(top + 1, bottom + 1):
            result.append(matrix[r][right])
        if top < bottom:
            for c in range(right - 1, left - 1, -1):
                result.append(matrix[bottom][c])
        if left < right:
            for r in range(bottom - 1, top, -1):
                result.append(matrix[r][left])
        top, bottom, left, right = top + 1, bottom - 1, left + 1, right - 1
    return result
""",
        cases=(
            ([],),
            ([[]],),
            ([[7]],),
            ([[1, 2, 3], [4, 5, 6]],),
            ([[1], [2], [3]],),
            ([[1, 2, 3, 4]],),
            ([[1, 2, 3], [4, 5, 6], [7, 8, 9]],),
            ([[r * 5 + c for c in range(5)] for r in range(4)],),
            ([[r * 3 + c for c in range(3)] for r in range(6)],),
        ),
    ),
    CodingTask(
        name="longest_unique_substring",
        function="longest_unique_substring",
        signature="def longest_unique_substring(text: str) -> str:",
        prompt=(
            "Write `longest_unique_substring(text)` that returns the longest contiguous substring of `text` "
            "in which no character occurs twice (case-sensitive). If several substrings share the maximum "
            'length, return the one that starts earliest; the empty string gives `""`. Example: `"abcadefa"` '
            'gives `"bcadef"`.'
        ),
        reference="""
def longest_unique_substring(text: str) -> str:
    last_seen = {}
    start = best_start = best_len = 0
    for i, ch in enumerate(text):
        if last_seen.get(ch, -1) >= start:
            start = last_seen[ch] + 1
        last_seen[ch] = i
        if i - start + 1 > best_len:
            best_start, best_len = start, i - start + 1
    return text[best_start : best_start + best_len]
""",
        cases=(
            ("",),
            ("a",),
            ("aaaa",),
            ("abcadefa",),
            ("abab",),
            ("aAbB aA",),
            ("ñandúñu",),
            ("xyzxyzabcd",),
            ("abcdefghij" * 20,),
        ),
    ),
    CodingTask(
        name="two_sum_indices",
        function="two_sum_indices",
        signature="def two_sum_indices(nums: list[int], target: int) -> list[int] | None:",
        prompt=(
            "Write `two_sum_indices(nums, target)` that finds indices i < j with `nums[i] + nums[j] == "
            "target` and returns `[i, j]`. When several pairs qualify, choose the one with the smallest j, "
            "and among those the smallest i. Return None if there is no such pair. Example: `([2, 5, 2, 3, "
            "1], 4)` gives `[0, 2]`; the pair `[3, 4]` (3 + 1) also sums to 4 but has a larger j."
        ),
        reference="""
def two_sum_indices(nums: list[int], target: int) -> list[int] | None:
    first_index = {}
    for j, value in enumerate(nums):
        if target - value in first_index:
            return [first_index[target - value], j]
        first_index.setdefault(value, j)
    return None
""",
        cases=(
            ([], 0),
            ([5], 10),
            ([3, 1, 2, 3], 4),
            ([1, 2, 3], 100),
            ([2, 2], 4),
            ([5, 0, -5, 5], 0),
            ([1, 5, 3, 3, 7], 6),
            ([10**9, -(10**9), 7], 10**9 + 7),
            (list(range(1000)), 1997),
        ),
    ),
    CodingTask(
        name="day_of_year",
        function="day_of_year",
        signature="def day_of_year(date: str) -> int:",
        prompt=(
            'Write `day_of_year(date)` where `date` is a valid Gregorian date written `"YYYY-MM-DD"` (year '
            "0001 to 9999). Return its 1-based position within its year (January 1 is day 1). Leap years are "
            "those divisible by 4, except years divisible by 100 that are not divisible by 400. Example: "
            '`"2024-03-01"` gives 61.'
        ),
        reference="""
def day_of_year(date: str) -> int:
    year, month, day = (int(part) for part in date.split("-"))
    leap = year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)
    lengths = [31, 29 if leap else 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]
    return sum(lengths[: month - 1]) + day
""",
        cases=(
            ("2024-01-01",),
            ("2024-03-01",),
            ("2023-03-01",),
            ("1900-12-31",),
            ("2000-12-31",),
            ("2000-02-29",),
            ("0001-07-04",),
            ("9999-12-31",),
            ("2100-03-01",),
        ),
    ),
    CodingTask(
        name="prime_factors",
        function="prime_factors",
        signature="def prime_factors(n: int) -> list[int]:",
        prompt=(
            "Write `prime_factors(n)` that returns the prime factorisation of an integer n >= 1 as a list of "
            "primes in non-decreasing order, each repeated as often as it divides `n`; `1` gives `[]`. "
            "Inputs can be around 10**12, so trial division must stop at the square root. Example: 360 gives "
            "`[2, 2, 2, 3, 3, 5]`."
        ),
        reference="""
def prime_factors(n: int) -> list[int]:
    factors = []
    p = 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    if n > 1:
        factors.append(n)
    return factors
""",
        cases=((1,), (2,), (360,), (97,), (1024,), (999983,), (2**31 - 1,), (600851475143,), (4294967297,)),
    ),
    CodingTask(
        name="compress_ranges",
        function="compress_ranges",
        signature="def compress_ranges(nums: list[int]) -> list[str]:",
        prompt=(
            "Write `compress_ranges(nums)`: take the distinct values of `nums` (which may be unsorted and "
            "contain duplicates), sort them, and describe them as maximal runs of consecutive integers. A "
            'run of a single value v is written `str(v)`; a longer run from a to b is written `f"{a}-{b}"` '
            '(so -3 through -1 is `"-3--1"`). Return the strings in ascending order; `[]` gives `[]`. '
            'Example: `[5, 1, 2, 3, 8, 9, 2]` gives `["1-3", "5", "8-9"]`.'
        ),
        reference="""
def compress_ranges(nums: list[int]) -> list[str]:
    values = sorted(set(nums))
    out = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return out
""",
        cases=(
            ([],),
            ([4],),
            ([4, 4, 4],),
            ([5, 1, 2, 3, 8, 9, 2],),
            ([-3, -2, -1, 1],),
            ([-1, 0, 1],),
            ([10, 8, 6],),
            ([*range(100), 200],),
        ),
    ),
    CodingTask(
        name="valid_ipv4",
        function="valid_ipv4",
        signature="def valid_ipv4(text: str) -> bool:",
        prompt=(
            "Write `valid_ipv4(text)` that returns True exactly when `text` is four parts joined by single "
            "dots, where each part is one to three ASCII digits `0`-`9` with value 0 to 255 and no leading "
            'zero (except the part `"0"` itself). Nothing else is allowed: no whitespace, signs, empty parts '
            'or non-ASCII digits. Examples: `"192.168.0.1"` gives True; `"01.2.3.4"` and `"1.2.3"` give '
            "False."
        ),
        reference="""
def valid_ipv4(text: str) -> bool:
    parts = text.split(".")
    if len(parts) != 4:
        return False
    for part in parts:
        if not 1 <= len(part) <= 3 or any(ch not in "0123456789" for ch in part):
            return False
        if part[0] == "0" and len(part) > 1:
            return False
        if int(part) > 255:
            return False
    return True
""",
        cases=(
            ("",),
            ("192.168.0.1",),
            ("0.0.0.0",),
            ("255.255.255.255",),
            ("256.1.1.1",),
            ("01.2.3.4",),
            ("1.2.3",),
            ("1.2.3.4.5",),
            ("1..2.3",),
            (" 1.2.3.4",),
            ("١.2.3.4",),
            ("1.2.3.+4",),
        ),
    ),
    CodingTask(
        name="count_islands",
        function="count_islands",
        signature="def count_islands(grid: list[str]) -> int:",
        prompt=(
            "Write `count_islands(grid)` where `grid` is a list of equal-length strings made of `'#'` (land) "
            "and `'.'` (water). An island is a maximal set of land cells connected through horizontal or "
            "vertical neighbours (diagonals do not connect). Return the number of islands; an empty grid has "
            'none. Example: `["#.#", "##.", "..#"]` gives 3.'
        ),
        reference="""
def count_islands(grid: list[str]) -> int:
    rows = len(grid)
    cols = len(grid[0]) if rows else 0
    seen = set()
    islands = 0
    for r in range(rows):
        for c in range(cols):
            if grid[r][c] != "#" or (r, c) in seen:
                continue
            islands += 1
            seen.add((r, c))
            stack = [(r, c)]
            while stack:
                y, x = stack.pop()
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < rows and 0 <= nx < cols and grid[ny][nx] == "#" and (ny, nx) not in seen:
                        seen.add((ny, nx))
                        stack.append((ny, nx))
    return islands
""",
        cases=(
            ([],),
            (["..."],),
            (["#"],),
            (["#.#", "##.", "..#"],),
            (["#.#.#", ".#.#.", "#.#.#"],),
            (["#####", "#...#", "#.#.#", "#...#", "#####"],),
            (["#" * 40] * 40,),
            (["#." * 20, ".#" * 20] * 20,),
            ([("#" * 5 + "." * 3) * 5 if r % 4 else "." * 40 for r in range(30)],),
        ),
    ),
    CodingTask(
        name="max_subarray_sum",
        function="max_subarray_sum",
        signature="def max_subarray_sum(nums: list[int]) -> int:",
        prompt=(
            "Write `max_subarray_sum(nums)` that returns the largest sum of a non-empty contiguous run of "
            "elements of `nums`. If every number is negative, the answer is the largest single element; if "
            "`nums` is empty, return 0. Example: `[2, -5, 3, -1, 4, -10]` gives 6 (from `[3, -1, 4]`)."
        ),
        reference="""
def max_subarray_sum(nums: list[int]) -> int:
    if not nums:
        return 0
    best = current = nums[0]
    for value in nums[1:]:
        current = max(value, current + value)
        best = max(best, current)
    return best
""",
        cases=(
            ([],),
            ([-3],),
            ([2, -5, 3, -1, 4, -10],),
            ([-8, -3, -6],),
            ([0, 0, 0],),
            ([1, 2, 3],),
            ([5, -(10**9), 5],),
            ([(-1) ** i * i for i in range(200)],),
        ),
    ),
    CodingTask(
        name="polygon_area",
        function="polygon_area",
        signature="def polygon_area(points: list[list[float]]) -> float:",
        prompt=(
            "Write `polygon_area(points)` where `points` lists the vertices `[x, y]` of a simple polygon in "
            "order around its boundary (clockwise or counter-clockwise). Return the polygon's area, which is "
            "never negative (the shoelace formula, then absolute value). With fewer than 3 points return "
            "0.0. Example: `[[0, 0], [4, 0], [4, 3]]` gives 6.0."
        ),
        reference="""
def polygon_area(points: list[list[float]]) -> float:
    if len(points) < 3:
        return 0.0
    twice = 0.0
    for i, (x1, y1) in enumerate(points):
        x2, y2 = points[(i + 1) % len(points)]
        twice += x1 * y2 - x2 * y1
    return abs(twice) / 2.0
""",
        cases=(
            ([],),
            ([[1, 1], [2, 2]],),
            ([[0, 0], [4, 0], [4, 3]],),
            ([[0, 0], [0, 2], [2, 2], [2, 0]],),
            ([[0, 0], [1, 0], [2, 0]],),
            ([[-1.5, -1.5], [1.5, -1.5], [1.5, 1.5], [-1.5, 1.5]],),
            ([[0, 0], [4, 0], [4, 4], [2, 1], [0, 4]],),
            ([[1000.25, 2000.5], [1010.75, 2000.5], [1005.5, 2020.0]],),
        ),
        compare="float",
    ),
    CodingTask(
        name="find_pairs_with_sum",
        function="find_pairs_with_sum",
        signature="def find_pairs_with_sum(nums: list[int], target: int) -> list[list[int]]:",
        prompt=(
            "Write `find_pairs_with_sum(nums, target)` that returns every distinct pair of values `[a, b]` "
            "with a <= b and a + b == target, where a and b come from two different positions of `nums`. "
            "Each pair of values appears once, however many ways it can be formed; write each pair with the "
            "smaller value first. The order of the pairs in the returned list does not matter. Example: "
            "`([1, 5, 3, 3, 7, 5], 8)` gives `[[1, 7], [3, 5]]`."
        ),
        reference="""
def find_pairs_with_sum(nums: list[int], target: int) -> list[list[int]]:
    counts = {}
    for value in nums:
        counts[value] = counts.get(value, 0) + 1
    pairs = []
    for a in sorted(counts):
        b = target - a
        if (a < b and b in counts) or (a == b and counts[a] >= 2):
            pairs.append([a, b])
    return pairs
""",
        cases=(
            ([], 5),
            ([4], 8),
            ([4, 4], 8),
            ([1, 5, 3, 3, 7, 5], 8),
            ([1, 2, 3], 100),
            ([-2, 2, 0, 0, -2, 4], 0),
            ([6, 4, 5, 5, 5, 2, 8], 10),
            (list(range(-20, 21)), 3),
        ),
        compare="unordered",
    ),
    CodingTask(
        name="group_anagrams",
        function="group_anagrams",
        signature="def group_anagrams(words: list[str]) -> list[list[str]]:",
        prompt=(
            "Write `group_anagrams(words)` that groups words that are anagrams of each other (the same "
            'characters with the same multiplicities; case-sensitive, so `"Ab"` and `"ba"` differ). Each '
            "group lists its words in their input order, duplicates kept, and groups are ordered by where "
            'their first word appears in the input; `[]` gives `[]`. Example: `["tea", "ate", "bat", "eat", '
            '"tab"]` gives `[["tea", "ate", "eat"], ["bat", "tab"]]`.'
        ),
        reference="""
def group_anagrams(words: list[str]) -> list[list[str]]:
    groups = {}
    for word in words:
        groups.setdefault("".join(sorted(word)), []).append(word)
    return list(groups.values())
""",
        cases=(
            ([],),
            (["solo"],),
            (["tea", "ate", "bat", "eat", "tab"],),
            (["Ab", "ba", "bA"],),
            (["", "", "a"],),
            (["listen", "silent", "enlist", "google", "gogole", "listen"],),
            (["été", "tée", "ete"],),
            (["abc", "def", "ghi"],),
        ),
    ),
    CodingTask(
        name="base_convert",
        function="base_convert",
        signature="def base_convert(digits: str, from_base: int, to_base: int) -> str:",
        prompt=(
            "Write `base_convert(digits, from_base, to_base)`. `digits` is an integer written in base "
            "`from_base` (2 to 36) with digits `0`-`9` then letters for 10 to 35 (upper or lower case "
            "accepted), optionally preceded by `-`. Return the same integer written in base `to_base` (2 to "
            "36) with uppercase letters, no leading zeros, and a leading `-` only when the value is "
            'negative, so zero is always `"0"`. Example: `("-ff", 16, 2)` gives `"-11111111"`.'
        ),
        reference="""
def base_convert(digits: str, from_base: int, to_base: int) -> str:
    alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    negative = digits.startswith("-")
    value = 0
    for ch in digits.lstrip("-").upper():
        value = value * from_base + alphabet.index(ch)
    if value == 0:
        return "0"
    out = []
    while value:
        value, rem = divmod(value, to_base)
        out.append(alphabet[rem])
    return ("-" if negative else "") + "".join(reversed(out))
""",
        cases=(
            ("0", 10, 2),
            ("-0", 7, 3),
            ("-ff", 16, 2),
            ("11111111", 2, 16),
            ("zz", 36, 10),
            ("255", 10, 36),
            ("000123", 10, 10),
            ("123456789012345678901234567890", 10, 36),
            ("-HelloWorld", 36, 8),
        ),
    ),
    CodingTask(
        name="reverse_bits",
        function="reverse_bits",
        signature="def reverse_bits(n: int, width: int) -> int:",
        prompt=(
            "Write `reverse_bits(n, width)`: treat `n` (0 <= n < 2**width, width >= 1) as a binary number of "
            "exactly `width` bits, leading zeros included, reverse the order of those bits, and return the "
            "resulting integer. Examples: `(1, 4)` gives 8 (0001 becomes 1000); `(6, 3)` gives 3."
        ),
        reference="""
def reverse_bits(n: int, width: int) -> int:
    result = 0
    for _ in range(width):
        result = (result << 1) | (n & 1)
        n >>= 1
    return result
""",
        cases=((0, 1), (1, 1), (1, 4), (6, 3), (0b1011, 8), (2**32 - 1, 32), (1, 64), (0x12345678, 32)),
    ),
    CodingTask(
        name="min_window_length",
        function="min_window_length",
        signature="def min_window_length(nums: list[int], target: int) -> int:",
        prompt=(
            "Write `min_window_length(nums, target)` where `nums` holds positive integers and target >= 1. "
            "Return the length of the shortest contiguous run of elements whose sum is at least `target`, or "
            "0 if no run (not even the whole list) reaches it. Example: `([2, 1, 5, 2, 8], 7)` gives 1 (the "
            "single 8)."
        ),
        reference="""
def min_window_length(nums: list[int], target: int) -> int:
    best = 0
    total = left = 0
    for right, value in enumerate(nums):
        total += value
        while total >= target:
            if best == 0 or right - left + 1 < best:
                best = right - left + 1
            total -= nums[left]
            left += 1
    return best
""",
        cases=(
            ([], 1),
            ([5], 5),
            ([5], 6),
            ([2, 1, 5, 2, 8], 7),
            ([2, 1, 5, 2, 3], 7),
            ([1, 1, 1, 1], 4),
            ([1, 2, 3], 100),
            ([1] * 500 + [50], 60),
        ),
    ),
    CodingTask(
        name="is_valid_sudoku",
        function="is_valid_sudoku",
        signature="def is_valid_sudoku(grid: list[str]) -> bool:",
        prompt=(
            "Write `is_valid_sudoku(grid)` where `grid` is 9 strings of 9 characters, each a digit `1`-`9` "
            "or `.` for an empty cell. Return True if no digit appears twice in any row, any column, or any "
            "of the nine 3x3 boxes (rows and columns 0-2, 3-5, 6-8), and False otherwise. The grid does not "
            "need to be complete or solvable; an all-empty grid is valid."
        ),
        reference="""
def is_valid_sudoku(grid: list[str]) -> bool:
    seen = set()
    for r in range(9):
        for c in range(9):
            digit = grid[r][c]
            if digit == ".":
                continue
            keys = [("row", r, digit), ("col", c, digit), ("box", r // 3, c // 3, digit)]
            if any(key in seen for key in keys):
                return False
            seen.update(keys)
    return True
""",
        cases=(
            (["." * 9] * 9,),
            (
                [
                    "534678912",
                    "672195348",
                    "198342567",
                    "859761423",
                    "426853791",
                    "713924856",
                    "961537284",
                    "287419635",
                    "345286179",
                ],
            ),
            (
                [
                    "534678912",
                    "672195348",
                    "198342567",
                    "859761423",
                    "426853791",
                    "713924856",
                    "961537284",
                    "287419635",
                    "345286197",
                ],
            ),
            (["11......."] + ["." * 9] * 8,),
            (["1........"] + ["." * 9] * 7 + ["1........"],),
            (["1........", "..1......"] + ["." * 9] * 7,),
            (["1........", "...1....."] + ["." * 9] * 7,),
            (["123456789", "456789123", "789123456"] + ["." * 9] * 6,),
        ),
    ),
)

# --------------------------------------------------------------------------------------------------
# Harder
# --------------------------------------------------------------------------------------------------

_HARDER = (
    CodingTask(
        name="evaluate_expression",
        function="evaluate_expression",
        signature="def evaluate_expression(expr: str) -> int:",
        prompt=(
            "Write `evaluate_expression(expr)` that evaluates an arithmetic expression built from "
            "non-negative integer literals, binary `+ - * /`, unary minus, parentheses and any number of "
            "spaces. `*` and `/` bind tighter than `+` and `-`, operators of equal precedence apply left to "
            "right, and unary minus binds tighter than everything else (`-7 / 2` is `(-7) / 2`; `--3` is 3; "
            "`2*-3` is allowed). `/` is integer division rounding toward negative infinity, like Python's "
            '`//`. The expression is always well-formed and never divides by zero. Example: `"2 + 3 * (4 - '
            '6) / 4"` gives 0.'
        ),
        reference="""
def evaluate_expression(expr: str) -> int:
    tokens = []
    i = 0
    while i < len(expr):
        ch = expr[i]
        if ch.isdigit():
            j = i
            while j < len(expr) and expr[j].isdigit():
                j += 1
            tokens.append(int(expr[i:j]))
            i = j
        else:
            if ch != " ":
                tokens.append(ch)
            i += 1
    pos = 0

    def parse_sum():
        nonlocal pos
        value = parse_product()
        while pos < len(tokens) and tokens[pos] in ("+", "-"):
            op = tokens[pos]
            pos += 1
            rhs = parse_product()
            value = value + rhs if op == "+" else value - rhs
        return value

    def parse_product():
        nonlocal pos
        value = parse_unary()
        while pos < len(tokens) and tokens[pos] in ("*", "/"):
            op = tokens[pos]
            pos += 1
            rhs = parse_unary()
            value = value * rhs if op == "*" else value // rhs
        return value

    def parse_unary():
        nonlocal pos
        token = tokens[pos]
        pos += 1
        if token == "-":
            return -parse_unary()
        if token == "(":
            value = parse_sum()
            pos += 1
            return value
        return token

    return parse_sum()
""",
        cases=(
            ("42",),
            ("  7  ",),
            ("2 + 3 * (4 - 6) / 4",),
            ("-7 / 2",),
            ("--3",),
            ("2*-3",),
            ("10 - 4 - 3",),
            ("100 / 10 / 3",),
            ("-(2 + 3) * -(4 - 10)",),
            ("((((1))))+((2*(3+4))-5)/2",),
            ("123456789 * 987654321 - 1",),
            ("1 - -1 - -(-1)",),
        ),
    ),
    CodingTask(
        name="run_stack_machine",
        function="run_stack_machine",
        signature="def run_stack_machine(program: list[str]) -> list[int] | None:",
        prompt=(
            "Write `run_stack_machine(program)` that runs a list of instructions on an integer stack, "
            "starting at index 0, and returns the list of values output. Instructions: `PUSH n` (push "
            "integer n, maybe negative), `POP`, `DUP` (copy top), `OVER` (push a copy of the second value "
            "from the top), `SWAP` (swap top two), `ADD`/`SUB`/`MUL` (pop b, then pop a, push a+b, a-b or "
            "a*b), `OUT` (pop and append to the output), `JMP k` (continue at index k), `JZ k` (pop; if it "
            "was 0 continue at index k). The program halts normally when the next index is outside the "
            "program (past the end or any out-of-range jump target). Return None instead if an instruction "
            "needs more values than the stack holds, or if 1000 instructions have executed and the program "
            "has still not halted."
        ),
        reference="""
def run_stack_machine(program: list[str]) -> list[int] | None:
    needs = {"PUSH": 0, "JMP": 0, "POP": 1, "DUP": 1, "OUT": 1, "JZ": 1,
             "OVER": 2, "SWAP": 2, "ADD": 2, "SUB": 2, "MUL": 2}
    stack, out, pc, steps = [], [], 0, 0
    while 0 <= pc < len(program):
        if steps == 1000:
            return None
        steps += 1
        op, *args = program[pc].split()
        if len(stack) < needs[op]:
            return None
        pc += 1
        if op == "PUSH":
            stack.append(int(args[0]))
        elif op == "POP":
            stack.pop()
        elif op == "DUP":
            stack.append(stack[-1])
        elif op == "OVER":
            stack.append(stack[-2])
        elif op == "SWAP":
            stack[-1], stack[-2] = stack[-2], stack[-1]
        elif op == "OUT":
            out.append(stack.pop())
        elif op == "JMP":
            pc = int(args[0])
        elif op == "JZ":
            if stack.pop() == 0:
                pc = int(args[0])
        else:
            b, a = stack.pop(), stack.pop()
            stack.append(a + b if op == "ADD" else a - b if op == "SUB" else a * b)
    return out
""",
        cases=(
            ([],),
            (["PUSH 2", "PUSH 3", "ADD", "PUSH -4", "MUL", "OUT"],),
            (["PUSH 10", "PUSH 3", "SUB", "OUT", "PUSH 1", "PUSH 2", "SWAP", "OUT", "OUT"],),
            (["PUSH 5", "DUP", "OUT", "PUSH 1", "SUB", "DUP", "JZ 8", "JMP 1", "POP"],),
            (
                [
                    "PUSH 5",
                    "PUSH 1",
                    "OVER",
                    "MUL",
                    "SWAP",
                    "PUSH 1",
                    "SUB",
                    "DUP",
                    "JZ 11",
                    "SWAP",
                    "JMP 2",
                    "POP",
                    "OUT",
                ],
            ),
            (["PUSH 1", "ADD"],),
            (["OUT"],),
            (["PUSH 7", "OUT", "JMP 0"],),
            (["PUSH 1", "OUT", "JMP 99", "PUSH 2", "OUT"],),
            (["PUSH 0", "JZ -1", "PUSH 3", "OUT"],),
            (["PUSH 1"] * 1000,),
            (["PUSH 1"] * 1001,),
        ),
    ),
    CodingTask(
        name="coin_change_min",
        function="coin_change_min",
        signature="def coin_change_min(coins: list[int], amount: int) -> int:",
        prompt=(
            "Write `coin_change_min(coins, amount)`: given positive coin denominations, each available in "
            "unlimited supply (the list may repeat a value), and a non-negative `amount`, return the "
            "smallest number of coins whose values add up to exactly `amount`, or -1 if that is impossible. "
            "Amount 0 needs 0 coins. Example: `([1, 3, 4], 6)` gives 2 (3 + 3)."
        ),
        reference="""
def coin_change_min(coins: list[int], amount: int) -> int:
    best = [0] + [-1] * amount
    for total in range(1, amount + 1):
        for coin in coins:
            if coin <= total and best[total - coin] >= 0:
                candidate = best[total - coin] + 1
                if best[total] < 0 or candidate < best[total]:
                    best[total] = candidate
    return best[amount]
""",
        cases=(
            ([1], 0),
            ([], 0),
            ([], 5),
            ([1, 3, 4], 6),
            ([2], 3),
            ([5, 10], 35),
            ([7, 7, 3], 20),
            ([186, 419, 83, 408], 6249),
            ([1, 5, 10, 25, 50], 9999),
        ),
    ),
    CodingTask(
        name="edit_distance",
        function="edit_distance",
        signature="def edit_distance(a: str, b: str) -> int:",
        prompt=(
            "Write `edit_distance(a, b)` that returns the minimum number of single-character insertions, "
            "deletions and substitutions needed to turn string `a` into string `b` (each operation costs 1; "
            'characters are compared case-sensitively). Example: `("sunday", "saturday")` gives 3.'
        ),
        reference="""
def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
""",
        cases=(
            ("", ""),
            ("", "abc"),
            ("abc", ""),
            ("same", "same"),
            ("sunday", "saturday"),
            ("Case", "case"),
            ("flaw", "lawn"),
            ("naïve", "naive"),
            ("abcdefghij" * 8, "bcdefghija" * 8),
        ),
    ),
    CodingTask(
        name="shortest_path_bfs",
        function="shortest_path_bfs",
        signature=(
            "def shortest_path_bfs(graph: dict[str, list[str]], start: str, goal: str) -> list[str] | None:"
        ),
        prompt=(
            "Write `shortest_path_bfs(graph, start, goal)`. `graph` maps each node name to a list of "
            "successor names (directed edges); a node that appears only as a successor has no outgoing "
            "edges. Return a path from `start` to `goal` with the fewest edges, as the list of nodes "
            "including both ends. If several shortest paths exist, return the lexicographically smallest "
            "one, comparing the paths as lists of strings node by node. Return `[start]` when start == goal "
            "and None when goal is unreachable."
        ),
        reference="""
from collections import deque


def shortest_path_bfs(graph: dict[str, list[str]], start: str, goal: str) -> list[str] | None:
    reverse = {}
    for node, successors in graph.items():
        for succ in successors:
            reverse.setdefault(succ, []).append(node)
    dist = {goal: 0}
    queue = deque([goal])
    while queue:
        node = queue.popleft()
        for pred in reverse.get(node, []):
            if pred not in dist:
                dist[pred] = dist[node] + 1
                queue.append(pred)
    if start not in dist:
        return None
    path = [start]
    while path[-1] != goal:
        d = dist[path[-1]]
        path.append(min(v for v in graph.get(path[-1], []) if dist.get(v) == d - 1))
    return path
""",
        cases=(
            ({}, "a", "a"),
            ({}, "a", "b"),
            ({"a": ["b"], "b": ["c"]}, "a", "c"),
            ({"a": ["b"], "b": ["c"]}, "c", "a"),
            ({"s": ["y", "x"], "x": ["t"], "y": ["t"]}, "s", "t"),
            ({"s": ["b", "a"], "a": ["m"], "b": ["c"], "c": ["t"], "m": ["n"], "n": ["t"]}, "s", "t"),
            ({"a": ["a", "b"], "b": ["a", "c"], "c": ["a"]}, "c", "b"),
            ({"s": ["z", "q"], "z": ["a"], "q": ["z", "t"], "a": ["t"]}, "s", "t"),
            ({str(i): [str(i + 1), str(i + 2)] for i in range(60)}, "0", "59"),
        ),
    ),
    CodingTask(
        name="topological_order",
        function="topological_order",
        signature="def topological_order(graph: dict[str, list[str]]) -> list[str] | None:",
        prompt=(
            "Write `topological_order(graph)`. `graph` maps node names to lists of nodes that must come "
            "after them (an entry `u: [v]` means u before v); the nodes are all keys plus every name in any "
            "list. Return an ordering of all nodes that respects every edge, built by repeatedly placing the "
            "alphabetically smallest node (ordinary string comparison) among those whose predecessors are "
            "all placed. Return None if a cycle (including a self-loop) makes an ordering impossible; `{}` "
            'gives `[]`. Example: `{"b": ["a"], "c": []}` gives `["b", "a", "c"]`.'
        ),
        reference="""
import heapq


def topological_order(graph: dict[str, list[str]]) -> list[str] | None:
    indegree = {}
    for node, successors in graph.items():
        indegree.setdefault(node, 0)
        for succ in successors:
            indegree[succ] = indegree.get(succ, 0) + 1
    ready = [node for node, deg in indegree.items() if deg == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        node = heapq.heappop(ready)
        order.append(node)
        for succ in graph.get(node, []):
            indegree[succ] -= 1
            if indegree[succ] == 0:
                heapq.heappush(ready, succ)
    return order if len(order) == len(indegree) else None
""",
        cases=(
            ({},),
            ({"solo": []},),
            ({"b": ["a"], "c": []},),
            ({"a": ["b"], "b": ["c"], "c": ["a"]},),
            ({"x": ["x"]},),
            ({"shirt": ["tie", "belt"], "tie": ["jacket"], "pants": ["shoes", "belt"], "belt": ["jacket"]},),
            ({"d": ["b", "b"], "c": ["b"], "a": []},),
            ({"B": ["a"], "a": ["C"], "b": []},),
            ({f"n{i:02d}": [f"n{j:02d}" for j in range(i + 1, 30, 7)] for i in range(30)},),
        ),
    ),
    CodingTask(
        name="knapsack_max_value",
        function="knapsack_max_value",
        signature="def knapsack_max_value(weights: list[int], values: list[int], capacity: int) -> int:",
        prompt=(
            "Write `knapsack_max_value(weights, values, capacity)`. Item i has weight `weights[i]` >= 0 and "
            "value `values[i]` >= 0, and each item can be taken at most once. Return the largest total value "
            "of a selection whose total weight is at most `capacity` (>= 0); with no items the answer is 0. "
            "Example: `([3, 4, 5], [30, 50, 60], 8)` gives 90."
        ),
        reference="""
def knapsack_max_value(weights: list[int], values: list[int], capacity: int) -> int:
    best = [0] * (capacity + 1)
    for weight, value in zip(weights, values):
        for c in range(capacity, weight - 1, -1):
            best[c] = max(best[c], best[c - weight] + value)
    return best[capacity]
""",
        cases=(
            ([], [], 10),
            ([5], [10], 4),
            ([5], [10], 5),
            ([3, 4, 5], [30, 50, 60], 8),
            ([0, 0, 2], [5, 7, 1], 0),
            ([1, 1, 1], [1, 2, 3], 2),
            ([12, 7, 11, 8, 9], [24, 13, 23, 15, 16], 26),
            ([i % 17 + 3 for i in range(40)], [(i * 37) % 101 for i in range(40)], 150),
        ),
    ),
    CodingTask(
        name="cheapest_path_cost",
        function="cheapest_path_cost",
        signature="def cheapest_path_cost(edges: list[list], start: str, goal: str) -> int | None:",
        prompt=(
            "Write `cheapest_path_cost(edges, start, goal)`. Each edge is `[u, v, w]`: a two-way road "
            "between towns named `u` and `v` costing `w` (a non-negative integer); the same pair of towns "
            "may be joined by several roads. Return the minimum total cost of travelling from `start` to "
            "`goal`, 0 when start == goal (even if the town has no roads), and None when `goal` cannot be "
            "reached."
        ),
        reference="""
import heapq


def cheapest_path_cost(edges: list[list], start: str, goal: str) -> int | None:
    adjacency = {}
    for u, v, w in edges:
        adjacency.setdefault(u, []).append((v, w))
        adjacency.setdefault(v, []).append((u, w))
    best = {start: 0}
    heap = [(0, start)]
    while heap:
        cost, town = heapq.heappop(heap)
        if town == goal:
            return cost
        if cost > best[town]:
            continue
        for nxt, w in adjacency.get(town, []):
            if nxt not in best or cost + w < best[nxt]:
                best[nxt] = cost + w
                heapq.heappush(heap, (cost + w, nxt))
    return None
""",
        cases=(
            ([], "a", "a"),
            ([], "a", "b"),
            ([["a", "b", 5]], "b", "a"),
            ([["a", "b", 5], ["a", "b", 2]], "a", "b"),
            ([["a", "b", 1], ["b", "c", 1], ["a", "c", 5]], "a", "c"),
            ([["a", "b", 0], ["b", "c", 0]], "c", "a"),
            ([["a", "b", 1], ["c", "d", 1]], "a", "d"),
            (
                [["s", "a", 4], ["s", "b", 1], ["b", "a", 2], ["a", "t", 1], ["b", "t", 7], ["t", "u", 3]],
                "s",
                "t",
            ),
            ([[f"v{i}", f"v{i + 1}", i % 5 + 1] for i in range(100)] + [["v0", "v100", 250]], "v0", "v100"),
        ),
    ),
    CodingTask(
        name="add_days",
        function="add_days",
        signature="def add_days(date: str, days: int) -> str:",
        prompt=(
            'Write `add_days(date, days)` where `date` is a valid Gregorian date `"YYYY-MM-DD"` and `days` '
            "is an integer that may be negative. Return the date `days` days later in the same format "
            "(4-digit zero-padded year, 2-digit month and day). Leap years are divisible by 4, except years "
            "divisible by 100 but not by 400, applied to all years; inputs and results stay within years "
            '0001 to 9999. Example: `("2024-02-28", 2)` gives `"2024-03-01"`.'
        ),
        reference="""
import datetime


def add_days(date: str, days: int) -> str:
    return (datetime.date.fromisoformat(date) + datetime.timedelta(days=days)).isoformat()
""",
        cases=(
            ("2024-02-28", 2),
            ("2023-02-28", 1),
            ("2024-01-15", 0),
            ("2024-01-01", -1),
            ("1900-02-28", 1),
            ("2000-02-28", 1),
            ("0001-01-01", 365),
            ("9999-12-31", -3652058),
            ("1999-12-31", 10000),
            ("2024-03-01", -366),
        ),
    ),
    CodingTask(
        name="expand_repeats",
        function="expand_repeats",
        signature="def expand_repeats(pattern: str) -> str:",
        prompt=(
            "Write `expand_repeats(pattern)`. The pattern contains lowercase letters, parentheses and "
            "decimal digits. Every parenthesised group is immediately followed by a count of one or more "
            "digits (which may be 0 or have several digits) and stands for its contents repeated that many "
            "times; groups can nest, and digits appear nowhere else. Return the fully expanded string. "
            'Examples: `"a(bc)3d"` gives `"abcbcbcd"`, `"(x(y)2)2"` gives `"xyyxyy"`, `"a(b)0c"` gives '
            '`"ac"`.'
        ),
        reference="""
def expand_repeats(pattern: str) -> str:
    stack = [[]]
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "(":
            stack.append([])
            i += 1
        elif ch == ")":
            j = i + 1
            while j < len(pattern) and pattern[j].isdigit():
                j += 1
            inner = "".join(stack.pop()) * int(pattern[i + 1 : j])
            stack[-1].append(inner)
            i = j
        else:
            stack[-1].append(ch)
            i += 1
    return "".join(stack[0])
""",
        cases=(
            ("",),
            ("plain",),
            ("a(bc)3d",),
            ("(x(y)2)2",),
            ("a(b)0c",),
            ("(ab)1",),
            ("(a)12",),
            ("((a)2(b)3)2c",),
            ("x(y(z)0w)2",),
            ("((((ab)2)2)2)2",),
        ),
    ),
    CodingTask(
        name="rational_to_decimal",
        function="rational_to_decimal",
        signature="def rational_to_decimal(numerator: int, denominator: int) -> str:",
        prompt=(
            "Write `rational_to_decimal(numerator, denominator)` (denominator != 0) that returns the exact "
            "decimal expansion of the fraction. Write the integer part; if the value is not a whole number, "
            "add `.` and the fractional digits, and if those digits repeat forever, enclose the shortest "
            "repeating block, starting as early as possible, in parentheses. Prefix `-` only when the value "
            'is negative. Examples: 1/3 gives `"0.(3)"`, -7/12 gives `"-0.58(3)"`, 10/4 gives `"2.5"`, 6/-3 '
            'gives `"-2"`, 0/-5 gives `"0"`.'
        ),
        reference="""
def rational_to_decimal(numerator: int, denominator: int) -> str:
    sign = "-" if (numerator < 0) != (denominator < 0) and numerator != 0 else ""
    num, den = abs(numerator), abs(denominator)
    whole, rem = divmod(num, den)
    if rem == 0:
        return f"{sign}{whole}"
    digits = []
    seen = {}
    while rem and rem not in seen:
        seen[rem] = len(digits)
        rem *= 10
        digits.append(str(rem // den))
        rem %= den
    if rem:
        start = seen[rem]
        frac = "".join(digits[:start]) + "(" + "".join(digits[start:]) + ")"
    else:
        frac = "".join(digits)
    return f"{sign}{whole}.{frac}"
""",
        cases=(
            (0, -5),
            (6, -3),
            (1, 3),
            (-7, 12),
            (10, 4),
            (1, 7),
            (-1, -8),
            (22, 7),
            (1, 6),
            (123456, 990),
            (1, 97),
            (5, 1),
        ),
    ),
    CodingTask(
        name="lru_cache_simulation",
        function="lru_cache_simulation",
        signature="def lru_cache_simulation(capacity: int, operations: list[list]) -> list:",
        prompt=(
            "Write `lru_cache_simulation(capacity, operations)` that simulates a least-recently-used cache "
            'holding at most `capacity` (>= 1) keys. Each operation is `["put", key, value]` or `["get", '
            "key]`. `put` stores or overwrites the key's value and makes the key the most recently used; "
            "when it adds a new key to a full cache, the least recently used key is evicted first. `get` "
            "returns the key's value and makes it the most recently used, or returns None (changing nothing) "
            "if the key is absent. Return the list of the results of the `get` operations, in order."
        ),
        reference="""
from collections import OrderedDict


def lru_cache_simulation(capacity: int, operations: list[list]) -> list:
    cache = OrderedDict()
    results = []
    for op in operations:
        key = op[1]
        if op[0] == "get":
            if key in cache:
                cache.move_to_end(key)
                results.append(cache[key])
            else:
                results.append(None)
        else:
            if key in cache:
                cache.move_to_end(key)
            elif len(cache) >= capacity:
                cache.popitem(last=False)
            cache[key] = op[2]
    return results
""",
        cases=(
            (1, []),
            (1, [["get", "a"]]),
            (
                2,
                [["put", "a", 1], ["put", "b", 2], ["get", "a"], ["put", "c", 3], ["get", "b"], ["get", "c"]],
            ),
            (
                2,
                [
                    ["put", "a", 1],
                    ["put", "b", 2],
                    ["put", "a", 10],
                    ["put", "c", 3],
                    ["get", "a"],
                    ["get", "b"],
                ],
            ),
            (1, [["put", 1, "x"], ["put", 2, "y"], ["get", 1], ["get", 2]]),
            (3, [["put", "k", [1, 2]], ["get", "k"], ["put", "k", None], ["get", "k"], ["get", "z"]]),
            (
                2,
                [
                    ["put", "a", 1],
                    ["put", "b", 2],
                    ["get", "a"],
                    ["get", "a"],
                    ["put", "c", 3],
                    ["get", "a"],
                    ["get", "b"],
                    ["get", "c"],
                    ["put", "d", 4],
                    ["get", "a"],
                    ["get", "c"],
                    ["get", "d"],
                ],
            ),
            (
                5,
                [["put", i % 9, i] for i in range(40)] + [["get", i] for i in range(9)],
            ),
        ),
    ),
    CodingTask(
        name="longest_palindromic_substring",
        function="longest_palindromic_substring",
        signature="def longest_palindromic_substring(text: str) -> str:",
        prompt=(
            "Write `longest_palindromic_substring(text)` that returns the longest contiguous substring of "
            "`text` that reads the same forwards and backwards, comparing characters exactly "
            "(case-sensitive, spaces and punctuation included). If several have the maximum length, return "
            'the one that starts earliest; the empty string gives `""`. Example: `"xabacabay"` gives '
            '`"abacaba"`.'
        ),
        reference="""
def longest_palindromic_substring(text: str) -> str:
    best_start, best_len = 0, 0
    for center in range(len(text)):
        for lo, hi in ((center, center), (center, center + 1)):
            while lo >= 0 and hi < len(text) and text[lo] == text[hi]:
                lo -= 1
                hi += 1
            if hi - lo - 1 > best_len:
                best_start, best_len = lo + 1, hi - lo - 1
    return text[best_start : best_start + best_len]
""",
        cases=(
            ("",),
            ("a",),
            ("ab",),
            ("xabacabay",),
            ("abba",),
            ("Aba",),
            ("abcbdeed",),
            ("a racecar!",),
            ("été à",),
            ("ab" * 100 + "c",),
        ),
    ),
    CodingTask(
        name="word_break_count",
        function="word_break_count",
        signature="def word_break_count(text: str, words: list[str]) -> int:",
        prompt=(
            "Write `word_break_count(text, words)` that counts the ways to cut `text` into consecutive "
            "pieces that are each equal to some word in `words` (all non-empty; words can be reused, and a "
            "word listed twice still counts once). Two ways differ if they cut at different positions. The "
            'empty text has exactly one way (no pieces). Example: `("banana", ["ba", "na", "nana", "ban", '
            '"ana"])` gives 3.'
        ),
        reference="""
def word_break_count(text: str, words: list[str]) -> int:
    vocab = set(words)
    ways = [1] + [0] * len(text)
    for end in range(1, len(text) + 1):
        for start in range(end):
            if ways[start] and text[start:end] in vocab:
                ways[end] += ways[start]
    return ways[len(text)]
""",
        cases=(
            ("", []),
            ("", ["a"]),
            ("abc", []),
            ("banana", ["ba", "na", "nana", "ban", "ana"]),
            ("banana", ["ba", "na", "na"]),
            ("abc", ["ab", "bc"]),
            ("a" * 60, ["a", "aa"]),
            ("aaaa", ["a", "aa", "aaa", "aaaa"]),
            ("ñañaña", ["ña", "ñaña"]),
        ),
    ),
    CodingTask(
        name="matrix_determinant",
        function="matrix_determinant",
        signature="def matrix_determinant(matrix: list[list[int]]) -> int:",
        prompt=(
            "Write `matrix_determinant(matrix)` that returns the determinant of a square matrix of integers "
            "as an exact integer (avoid floating point: results can exceed 2**53). The empty matrix `[]` has "
            "determinant 1. Example: `[[2, 1], [7, 4]]` gives 1."
        ),
        reference="""
from fractions import Fraction


def matrix_determinant(matrix: list[list[int]]) -> int:
    rows = [[Fraction(x) for x in row] for row in matrix]
    n = len(rows)
    det = Fraction(1)
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col] != 0), None)
        if pivot is None:
            return 0
        if pivot != col:
            rows[col], rows[pivot] = rows[pivot], rows[col]
            det = -det
        det *= rows[col][col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            for c in range(col, n):
                rows[r][c] -= factor * rows[col][c]
    return int(det)
""",
        cases=(
            ([],),
            ([[-7]],),
            ([[2, 1], [7, 4]],),
            ([[1, 2], [2, 4]],),
            ([[0, 1], [1, 0]],),
            ([[2, -3, 1], [2, 0, -1], [1, 4, 5]],),
            ([[0, 0, 1], [0, 1, 0], [1, 0, 0]],),
            ([[(i * i * 5 + j * j * 3 + i * j * 7 + 1) % 23 - 11 for j in range(6)] for i in range(6)],),
            ([[10**6 if i == j else i + j for j in range(5)] for i in range(5)],),
            ([[1, 2, 3], [4, 5, 6], [7, 8, 9]],),
        ),
    ),
    CodingTask(
        name="connected_components",
        function="connected_components",
        signature="def connected_components(graph: dict[str, list[str]]) -> list[list[str]]:",
        prompt=(
            "Write `connected_components(graph)` for an undirected graph given as adjacency lists: an edge "
            "may be listed from one side only, and a name that appears only inside a list is still a node. "
            "Return the connected components, each as a list of its node names sorted in ascending order; "
            'the order of the components in the returned list does not matter. Example: `{"a": ["b"], "c": '
            '[], "d": ["c"]}` gives `[["a", "b"], ["c", "d"]]`.'
        ),
        reference="""
def connected_components(graph: dict[str, list[str]]) -> list[list[str]]:
    adjacency = {}
    for node, neighbours in graph.items():
        adjacency.setdefault(node, set())
        for other in neighbours:
            adjacency[node].add(other)
            adjacency.setdefault(other, set()).add(node)
    seen = set()
    components = []
    for node in sorted(adjacency):
        if node in seen:
            continue
        seen.add(node)
        stack, members = [node], []
        while stack:
            current = stack.pop()
            members.append(current)
            for other in adjacency[current]:
                if other not in seen:
                    seen.add(other)
                    stack.append(other)
        components.append(sorted(members))
    return components
""",
        cases=(
            ({},),
            ({"a": []},),
            ({"a": ["a"]},),
            ({"a": ["b"], "c": [], "d": ["c"]},),
            ({"x": ["y", "z"], "w": ["z"]},),
            ({"1": ["2"], "3": ["4"], "5": ["6"], "2": ["3"]},),
            ({"b": [], "a": [], "c": []},),
            ({f"n{i}": [f"n{(i * 3) % 40}"] for i in range(40)},),
        ),
        compare="unordered",
    ),
)

TASKS: tuple[CodingTask, ...] = _EASY + _MEDIUM + _HARDER


def _round_trips(value: Any) -> bool:
    """Whether `value` survives `json.dumps`/`json.loads` unchanged (types included, floats finite)."""
    try:
        decoded = json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return False
    return _same(decoded, value)


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float):
        return math.isfinite(a) and a == b
    return a == b


def check_tasks(tasks: tuple[CodingTask, ...] = TASKS) -> None:
    """Validate the task set; raise ValueError naming the task (and case) on the first problem found.

    Checks: unique names, consistent function/signature/reference, a known compare mode, 6 to 12 cases of
    JSON-representable arguments, and a reference that runs on every case (on deep copies of the
    arguments) and returns a JSON-representable value.
    """
    names: set[str] = set()
    for task in tasks:
        where = f"task {task.name!r}"
        if not task.name.isidentifier() or task.name != task.name.lower():
            raise ValueError(f"{where}: name must be a snake_case identifier")
        if task.name in names:
            raise ValueError(f"{where}: duplicate name")
        names.add(task.name)
        if not task.function.isidentifier():
            raise ValueError(f"{where}: function {task.function!r} is not an identifier")
        if not task.signature.startswith(f"def {task.function}(") or not task.signature.endswith(":"):
            raise ValueError(f"{where}: signature does not define {task.function!r}")
        if task.signature not in task.reference:
            raise ValueError(f"{where}: reference does not use the signature verbatim")
        if f"`{task.function}(" not in task.prompt:
            raise ValueError(f"{where}: prompt does not name the function")
        if task.compare not in COMPARE_MODES:
            raise ValueError(f"{where}: unknown compare mode {task.compare!r}")
        if not 6 <= len(task.cases) <= 12:
            raise ValueError(f"{where}: has {len(task.cases)} cases, expected 6 to 12")

        namespace: dict[str, Any] = {}
        try:
            exec(compile(task.reference, f"<reference {task.name}>", "exec"), namespace)
        except Exception as exc:
            raise ValueError(f"{where}: reference does not compile: {exc!r}") from exc
        function = namespace.get(task.function)
        if not callable(function):
            raise ValueError(f"{where}: reference does not define {task.function!r}")

        for index, case in enumerate(task.cases):
            at = f"{where}, case {index}"
            if not isinstance(case, tuple):
                raise ValueError(f"{at}: a case must be a tuple of positional arguments")
            if not _round_trips(list(case)):
                raise ValueError(f"{at}: arguments are not JSON-representable")
            try:
                result = function(*copy.deepcopy(case))
            except Exception as exc:
                raise ValueError(f"{at}: reference raised {exc!r}") from exc
            if not _round_trips(result):
                raise ValueError(f"{at}: result {result!r} is not JSON-representable")
            if task.compare == "unordered" and not isinstance(result, list):
                raise ValueError(f"{at}: compare='unordered' needs a list result")
