// A driver over llama.cpp's own n-gram drafters (common/ngram-map.cpp, ngram-mod.cpp, ngram-cache.cpp
// of the pinned version, compiled by tests/test_ngram_family.py with stub llama.h/common.h/log.h).
// The two impl structs below copy common_speculative_impl_ngram_mod / _ngram_cache of
// common/speculative.cpp line for line (speculative.cpp itself needs all of libllama).
//
// stdin, one command a line:
//   init k|k4v SIZE_N SIZE_M MIN_HITS  |  init mod N_MATCH N_MIN N_MAX  |  init cache STATIC|- DYNAMIC|-
//   begin L t1..tL                      the prompt
//   draft N_MAX L t1..tL                ctx = history + [id_last]; prints "d" and the draft cut to N_MAX
//   accept N                            the verify pass of the last draft accepted N tokens
//   order K t1..tK                      emplace t1..tK into a std::unordered_map<llama_token, int32_t>
//                                       and print "o" and its iteration order
#include "ngram-cache.h"
#include "ngram-map.h"
#include "ngram-mod.h"

#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <unordered_map>

struct mod_impl {
    int32_t n_match, n_min, n_max;
    common_ngram_mod mod;
    size_t i_last = 0, n_draft_last = 0;
    int n_low = 0;

    mod_impl(int32_t a, int32_t b, int32_t c) : n_match(a), n_min(b), n_max(c), mod(a, 4*1024*1024) {}

    void begin(const llama_tokens & prompt) {
        i_last = 0;
        n_draft_last = 0;
        const size_t n = mod.get_n();
        if (prompt.size() < n) {
            return;
        }
        for (size_t i = 0; i < prompt.size() - n; ++i) {
            mod.add(prompt.data() + i);
        }
        i_last = prompt.size() - n;
        const double f = (double)mod.get_used() / (double)mod.size();
        if (f > 0.25) {
            mod.reset();
        }
    }

    void draft_one(const llama_tokens & prompt, llama_token id_last, llama_tokens & result) {
        n_draft_last = 0;
        const size_t cur_len = prompt.size();
        if (cur_len < mod.get_n()) {
            return;
        }
        const size_t n = mod.get_n();
        if (i_last + 32 < cur_len) {
            for (size_t i = i_last; i < cur_len - n; ++i) {
                mod.add(prompt.data() + i);
            }
            i_last = cur_len - n;
        }
        result.resize(n + n_max);
        for (size_t i = 0; i < n - 1; ++i) {
            result[i] = prompt.at(cur_len - n + 1 + i);
        }
        result[n - 1] = id_last;
        for (int i = 0; i < n_max; ++i) {
            const llama_token token = mod.get(result.data() + i);
            if (token == common_ngram_mod::EMPTY) {
                if (i < n_min) {
                    result.clear();
                    return;
                }
                result.resize(n + i);
                break;
            }
            result[n + i] = token;
        }
        for (size_t i = 0; n + i < result.size(); ++i) {
            result[i] = result[n + i];
        }
        result.resize(result.size() - n);
        n_draft_last = result.size();
    }

    void accept(uint16_t n_accepted) {
        if (n_draft_last > 0) {
            const double f_acc = (double)n_accepted / (double)n_draft_last;
            if (f_acc < 0.25) {
                n_low++;
                if (n_low >= 5) {
                    mod.reset();
                    n_low = 0;
                    i_last = 0;
                }
            } else {
                n_low = 0;
            }
        }
    }
};

struct cache_impl {
    size_t cache_size = 0;
    common_ngram_cache ngram_cache_context, ngram_cache_dynamic, ngram_cache_static;

    void draft_one(const llama_tokens & prompt, llama_token id_last, llama_tokens & result) {
        if (cache_size < prompt.size() + 1) {
            llama_tokens tokens_new;
            for (size_t j = cache_size; j < prompt.size(); ++j) {
                tokens_new.push_back(prompt[j]);
            }
            tokens_new.push_back(id_last);
            common_ngram_cache_update(ngram_cache_context, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX,
                                      tokens_new, tokens_new.size(), false);
            cache_size = prompt.size() + 1;
        }
        llama_tokens inp(prompt);
        inp.push_back(id_last);
        result.push_back(id_last);
        common_ngram_cache_draft(inp, result, 8, LLAMA_NGRAM_MIN, LLAMA_NGRAM_MAX,
                                 ngram_cache_context, ngram_cache_dynamic, ngram_cache_static);
        if (result.size() > 0) {
            result.erase(result.begin());
        }
    }
};

static llama_tokens read_tokens(std::istringstream & ss) {
    size_t n;
    ss >> n;
    llama_tokens out(n);
    for (auto & t : out) {
        ss >> t;
    }
    return out;
}

int main() {
    std::unique_ptr<common_ngram_map> map;
    std::unique_ptr<mod_impl> mod;
    std::unique_ptr<cache_impl> cache;
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream ss(line);
        std::string cmd;
        ss >> cmd;
        if (cmd == "init") {
            std::string type;
            ss >> type;
            if (type == "k" || type == "k4v") {
                int n, m, h;
                ss >> n >> m >> h;
                map.reset(new common_ngram_map(n, m, type == "k", h));
            } else if (type == "mod") {
                int a, b, c;
                ss >> a >> b >> c;
                mod.reset(new mod_impl(a, b, c));
            } else {
                std::string s, d;
                ss >> s >> d;
                cache.reset(new cache_impl());
                if (s != "-") cache->ngram_cache_static = common_ngram_cache_load(s);
                if (d != "-") cache->ngram_cache_dynamic = common_ngram_cache_load(d);
            }
        } else if (cmd == "begin") {
            const llama_tokens prompt = read_tokens(ss);
            if (map) common_ngram_map_begin(*map, prompt);
            if (mod) mod->begin(prompt);
        } else if (cmd == "draft") {
            int n_max;
            ss >> n_max;
            llama_tokens inp = read_tokens(ss);
            const llama_token id_last = inp.back();
            inp.pop_back();
            llama_tokens draft;
            if (map) common_ngram_map_draft(*map, inp, id_last, draft);
            if (mod) mod->draft_one(inp, id_last, draft);
            if (cache) cache->draft_one(inp, id_last, draft);
            if ((int) draft.size() > n_max) draft.resize(n_max);
            std::cout << "d";
            for (auto t : draft) std::cout << ' ' << t;
            std::cout << '\n';
        } else if (cmd == "order") {
            std::unordered_map<llama_token, int32_t> part;
            for (auto t : read_tokens(ss)) part.emplace(t, 1);
            std::cout << "o";
            for (auto & kv : part) std::cout << ' ' << kv.first;
            std::cout << '\n';
        } else if (cmd == "accept") {
            int n;
            ss >> n;
            if (map) common_ngram_map_accept(*map, n);
            if (mod) mod->accept(n);
        }
    }
    return 0;
}
