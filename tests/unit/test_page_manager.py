from mlc.engine.page_manager import NULL_PAGE, PageManager
from mlc.engine.sampling_params import SamplingParams
from mlc.engine.sequence import Sequence


def seq(tokens, adapter=0):
    return Sequence("r", list(tokens), SamplingParams(max_new_tokens=4), adapter_id=adapter)


def computed(bm, s):
    bm.grow(s, len(s))
    s.num_cached = s.num_cache_entries = len(s)
    bm.register_full_pages(s)


def test_pages_are_handed_out_and_all_come_back():
    bm = PageManager(num_pages=9, page_size=4)
    a, b = seq(range(10)), seq(range(100, 105))
    bm.grow(a, 10)
    bm.grow(b, 5)
    assert len(a.page_table) == 3 and len(b.page_table) == 2
    assert NULL_PAGE not in a.page_table + b.page_table
    assert bm.num_free_pages == 8 - 5
    bm.free(a)
    bm.free(b)
    assert bm.num_free_pages == bm.usable_pages == 8


def test_prefix_cache_hits_full_pages_and_always_recomputes_the_tail():
    bm = PageManager(num_pages=16, page_size=4)
    first = seq(range(12))
    computed(bm, first)
    pages = list(first.page_table)
    bm.free(first)
    again = seq(list(range(12)) + [99])
    assert bm.match_prefix(again) == 12
    assert again.page_table == pages
    exact = seq(range(12))  # whole prompt cached: the last page is recomputed, never written in place
    assert bm.match_prefix(exact) == 8
    assert bm.prefix_hits == 5


def test_prefix_cache_is_keyed_by_adapter_and_parent():
    bm = PageManager(num_pages=16, page_size=4)
    computed(bm, seq(range(9)))
    assert bm.match_prefix(seq(range(9), adapter=1)) == 0
    other = seq([7, 7, 7, 7] + list(range(4, 9)))  # same second page, different first page
    assert bm.match_prefix(other) == 0


def test_cached_pages_are_reused_last_and_evicted_when_needed():
    bm = PageManager(num_pages=5, page_size=2)
    a = seq([1, 2, 3, 4, 5])
    computed(bm, a)
    bm.free(a)
    assert bm.num_free_pages == 4
    b = seq([9, 9, 9, 9, 9, 9, 9, 9])
    bm.grow(b, 8)  # needs every page, evicting the cached ones
    assert bm.num_free_pages == 0
    bm.free(b)
    assert bm.match_prefix(seq([1, 2, 3, 4, 5])) == 0


def test_fork_shares_pages_and_copies_the_partial_page_on_write():
    bm = PageManager(num_pages=10, page_size=4)
    parent = seq(range(6))
    computed(bm, parent)
    child = seq(range(6))
    bm.fork(parent, child)
    assert child.page_table == parent.page_table
    copies = bm.grow(child, 7)
    assert len(copies) == 1 and copies[0].src == parent.page_table[1] and copies[0].num_entries == 2
    assert child.page_table[0] == parent.page_table[0] and child.page_table[1] != parent.page_table[1]
    assert bm.grow(parent, 7) == []  # the parent now owns its page alone
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_pages == bm.usable_pages
