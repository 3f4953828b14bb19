// The dictionary cache's exact window (kvdict_vk.window: the one definition; docs/ARENA.md):
// at n cached tokens, tokens [sink, coded_end) are read from their slots, the rest from the
// window's binary16 rows — row t for a sink token, sink + (t - sink) mod recent after it.

uint window_coded_end(uint n, uint sink, uint recent) {
    return max(sink, n > recent ? n - recent : 0u);
}

// The token window row r holds at n cached tokens (≥ n: none, a row not yet written).
uint window_token(uint r, uint n, uint sink, uint recent) {
    if (r < sink)
        return r;
    uint coded_end = window_coded_end(n, sink, recent);
    return coded_end + (r - sink + recent - (coded_end - sink) % recent) % recent;
}

// The window row that keeps token t (a sink token, or with recent > 0 any later one).
uint window_row(uint t, uint sink, uint recent) {
    return t < sink ? t : sink + (t - sink) % recent;
}
