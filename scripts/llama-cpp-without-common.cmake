# Included at llama.cpp's project() call by scripts/install-llama-cpp.sh (CMAKE_PROJECT_llama.cpp_INCLUDE).
# llama-cpp-python forces llama.cpp's "common" library on (a cache variable set with FORCE), but its Python package
# loads only libllama and ggml's libraries, and this project reads nothing else: common (argument parsing, chat
# parsers, JSON, downloads) and the HTTP library it pulls in are half the build's compile time. A normal variable
# outranks the cache one, and llama.cpp's option() leaves a normal variable as it is (policy CMP0077).
set(LLAMA_BUILD_COMMON OFF)
