from lily.runtime.stops import StopMatcher


def feed_all(stops, pieces):
    m = StopMatcher(stops)
    out = "".join(m.feed(p) for p in pieces)
    return out + m.flush(), m.stopped


def test_stop_string_split_across_pieces_is_not_emitted():
    assert feed_all(["STOP"], ["hello S", "T", "OP world"]) == ("hello ", True)


def test_false_start_is_released():
    assert feed_all(["STOP"], ["a ST", "ar", "t"]) == ("a STart", False)


def test_earliest_of_several_stops_wins():
    assert feed_all(["xyz", "b"], ["axy", "zb"]) == ("a", True)


def test_held_text_is_flushed_at_end():
    assert feed_all(["</end>"], ["text </e"]) == ("text </e", False)


def test_no_stops_passes_through():
    assert feed_all([], ["a", "b"]) == ("ab", False)
