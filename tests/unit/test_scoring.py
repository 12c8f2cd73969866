"""structspec.scoring: a result against the expected value, one check per value."""

from __future__ import annotations

from structspec.scoring import ABSENT, Check, score, same_value

INVOICE = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string"},
        "issue_date": {"type": "string"},
        "note": {"type": "string"},
        "total_due": {"type": "number"},
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "price": {"type": "number"}, "sku": {"type": "string"}},
            "required": ["name", "price"]}},
    },
    "required": ["invoice_number", "issue_date", "total_due"],
}


def right(checks: list[Check]) -> tuple[int, int]:
    return sum(c.right for c in checks), len(checks)


def test_strings_match_with_whitespace_and_case_normalised():
    assert same_value("Tideway  Logistics\nLtd", " tideway logistics LTD ")
    assert not same_value("Tideway Logistics", "Tideway Logistic")


def test_numbers_match_by_value_never_as_strings():
    assert same_value(10, 10.0) and same_value(279.84, 279.84)
    assert not same_value(10, "10.00") and not same_value("10.00", 10)
    assert not same_value(1, True) and same_value(False, False)
    assert same_value(None, None) and not same_value(None, "")


def test_dates_match_as_written():
    assert same_value("03/20/2023", "03/20/2023")
    assert not same_value("03/20/2023", "2023-03-20")


def test_all_right_with_optional_fields_absent_from_both():
    truth = {"invoice_number": "INV/2023/03/0008", "issue_date": "03/20/2023", "total_due": 279.84}
    checks = score(truth, {"invoice_number": "inv/2023/03/0008", "issue_date": "03/20/2023", "total_due": 279.84},
                   INVOICE)
    assert [(c.pointer, c.right) for c in checks] == [
        ("/invoice_number", True), ("/issue_date", True), ("/total_due", True), ("/note", True), ("/items", True)]


def test_wrong_values_keep_what_was_expected_and_what_came_out():
    truth = {"invoice_number": "INV/2023/03/0008", "issue_date": "03/20/2023", "total_due": 279.84}
    checks = score(truth, {"invoice_number": "10.00", "issue_date": "202309097001", "total_due": 279.84})
    assert checks == [Check("/invoice_number", "INV/2023/03/0008", "10.00", False),
                      Check("/issue_date", "03/20/2023", "202309097001", False),
                      Check("/total_due", 279.84, 279.84, True)]


def test_a_missing_value_is_wrong_and_an_extra_one_is_one_more_wrong_check():
    truth = {"invoice_number": "A1", "issue_date": "1 May", "total_due": 5}
    checks = score(truth, {"invoice_number": "A1", "total_due": 5, "note": "paid"}, INVOICE)
    assert [(c.pointer, c.expected, c.actual, c.right) for c in checks] == [
        ("/invoice_number", "A1", "A1", True),
        ("/issue_date", "1 May", ABSENT, False),
        ("/total_due", 5, 5, True),
        ("/note", ABSENT, "paid", False),
        ("/items", ABSENT, ABSENT, True),
    ]


def test_list_items_are_compared_in_order_missing_items_count_each_value():
    truth = {"invoice_number": "A1", "issue_date": "1 May", "total_due": 5,
             "items": [{"name": "Milo 1kg", "price": 21.5}, {"name": "Eggs (10)", "price": 6.8}]}
    result = {"invoice_number": "A1", "issue_date": "1 May", "total_due": 5,
              "items": [{"name": "milo 1KG", "price": 21.50}]}
    checks = score(truth, result, INVOICE)
    assert [(c.pointer, c.right) for c in checks] == [
        ("/invoice_number", True), ("/issue_date", True), ("/total_due", True),
        ("/items/0/name", True), ("/items/0/price", True), ("/items/0/sku", True),
        ("/items/1/name", False), ("/items/1/price", False),
        ("/note", True)]
    assert checks[6] == Check("/items/1/name", "Eggs (10)", ABSENT, False)


def test_an_extra_list_item_is_one_wrong_check():
    checks = score({"tags": ["a"]}, {"tags": ["A", {"b": 1}]})
    assert checks == [Check("/tags/0", "a", "A", True), Check("/tags/1", ABSENT, {"b": 1}, False)]


def test_a_value_of_the_wrong_shape_misses_every_expected_value_and_is_extra():
    checks = score({"seller": {"name": "OYO", "city": "Chennai"}}, {"seller": "OYO"})
    assert checks == [Check("/seller/name", "OYO", ABSENT, False), Check("/seller/city", "Chennai", ABSENT, False),
                      Check("/seller", ABSENT, "OYO", False)]


def test_no_result_at_all_gets_every_expected_value_wrong():
    truth = {"name": "Chloe Martin", "phones": ["+33 4 55 55 01 42", "07700 900 412"]}
    checks = score(truth, ABSENT)
    assert right(checks) == (0, 3)
    assert [c.pointer for c in checks] == ["/name", "/phones/0", "/phones/1"]
