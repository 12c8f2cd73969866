"""The OCR comparison's accuracy measures: words against a text layer, expected field values
in the spellings a document may use."""

from __future__ import annotations

from bench import ocr


def test_words_count_repeats_and_ignore_case_and_surrounding_punctuation():
    scores = ocr.word_scores("Total: 4.11 USD\nTotal due", "total 4.11 usd, TotalDue")
    # reference words: total x2, 4.11, usd, due; found as words: total, 4.11, usd
    assert scores == {"reference_words": 5, "recall": 0.6, "precision": 0.75, "recall_ignoring_spaces": 1.0}


def test_numbers_are_read_in_either_decimal_convention():
    assert ocr.numbers_in("Rs 1,939.00 / 4,11 € / 1.234,50 / 319") == [1939.0, 4.11, 1234.5, 319.0]


def test_a_field_value_is_found_as_written_dates_in_the_usual_spellings():
    text = "Invoice Date: 20-10-2015\nGrand Total ₹ 319.00\nOYO4189 Resort"
    assert ocr.holds(text, "2015-10-20") and ocr.holds(text, 319.0) and not ocr.holds(text, 31.9)
    assert not ocr.holds(text, "OYO 4189 Resort") and ocr.holds(text, "OYO 4189 Resort", ignore_spaces=True)
    expected = {"date": "2015-10-20", "amount": 319.0, "issuer": "Flipkart", "lines": [{"name": "OYO 4189 Resort"}]}
    # "Flipkart" is not in the reference either: not findable, so not counted against the OCR
    scores = ocr.field_scores(expected, text, reference="20/10/2015 319 OYO 4189 Resort")
    assert scores == {"findable": 3, "found": 2, "found_ignoring_spaces": 3, "missed": ["/lines/0/name"]}
